"""Converting a GGUF file, once, into a Hugging Face checkpoint directory in the cache.

The conversion goes through transformers' GGUF support; the directory also holds an index of
where the file's tensors lie (for the `native` weight format), and RoPE scaling that
transformers' GGUF reader drops is carried over.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from delspec.architectures import config_from_hf
from delspec.cache import build_once, cache_dir, file_key
from delspec.errors import LIBRARY_ERRORS, ModelFormatError
from delspec.modules import rope_inv_freq
from delspec.weight_formats import TENSOR_INDEX, write_tensor_index

# ggml tensor types that the gguf package dequantises (floats, legacy, K- and I-quants).
_T = gguf.GGMLQuantizationType
SUPPORTED_GGML_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
    | {_T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S}
    | {_T.IQ4_NL, _T.IQ4_XS}
)


def converted_path(path: Path) -> Path:
    """Where the Hugging Face directory of GGUF file `path` is cached (once converted): a cache
    entry keyed by the file's size, mtime and first MiB."""
    return cache_dir() / "gguf" / f"{path.stem}-{file_key(path)}"


def converted_checkpoint(path: Path) -> Path:
    """The cached Hugging Face directory of GGUF file `path` (`converted_path`), converting it
    on first use. The cache entry appears atomically."""
    target = converted_path(path)

    def convert(out: Path) -> None:
        reader, architecture = _check_gguf(path)
        print(
            f"delspec: converting {path.name} (first load only, cached in {target})",
            file=sys.stderr,
            flush=True,
        )
        _convert_gguf(path, reader, architecture, out)
        write_tensor_index(reader, architecture, out / TENSOR_INDEX)

    return build_once(target, path, convert)


def _convert_gguf(path: Path, reader: gguf.GGUFReader, architecture: str, out: Path) -> None:
    """Write checked GGUF file `path` (open in `reader`) as a Hugging Face checkpoint directory
    `out`."""
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except LIBRARY_ERRORS as exc:  # the file is whole, so transformers cannot map it
        raise ModelFormatError(
            f"unsupported architecture {architecture!r} in {path} ({exc})"
        ) from exc
    # reject unsupported families before the slow part
    head_dim = config_from_hf(config.to_dict()).head_dim
    _carry_rope_scaling(path, reader, architecture, head_dim, config)
    try:
        with torch.device("meta"):  # only its parameter names are used, to name the tensors
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except LIBRARY_ERRORS as exc:
        raise ModelFormatError(f"cannot convert {path}: {exc}") from exc
    state = {name: t.contiguous() for name, t in tensors["tensors"].items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _carry_rope_scaling(
    path: Path, reader: gguf.GGUFReader, architecture: str, head_dim: int, config: Any
) -> None:
    """Put GGUF file `path`'s RoPE scaling (read from `reader`) into transformers `config`,
    whose GGUF reader drops it.

    llama.cpp writes linear scaling as `{arch}.rope.scaling.type`/`.factor`, and Llama 3
    scaling as a `rope_freqs` tensor of per-frequency divisors; the `llama3` parameters that
    give those divisors are fitted back from them. Scaling applies to global-attention layers.
    """
    kind_field = reader.fields.get(f"{architecture}.rope.scaling.type")
    kind = str(kind_field.contents()) if kind_field is not None else "none"
    factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    params = copy.deepcopy(config.rope_parameters)
    target = params.get("full_attention", params)  # Gemma 3: per attention type
    if factors is not None:
        divisors = torch.from_numpy(factors.data.copy()).float().flatten()
        scaling = _llama3_scaling(divisors, head_dim, target["rope_theta"])
        if scaling is None:
            raise ModelFormatError(
                f"{path}: its RoPE frequency factors (rope_freqs) are not Llama 3 scaling"
            )
        target.update(scaling)
    elif kind == "linear":
        factor = reader.fields[f"{architecture}.rope.scaling.factor"].contents()
        target.update(rope_type="linear", factor=float(factor))
    elif kind == "none":
        return
    else:
        raise ModelFormatError(
            f"{path}: unsupported RoPE scaling {kind!r} (supported: linear, llama3)"
        )
    config.rope_parameters = params


def _llama3_scaling(factors: Tensor, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The `llama3` RoPE parameters whose per-frequency divisors are `factors`.

    Between the two bands (divisor 1 at short wavelengths, `factor` at long ones) the inverse
    divisor is linear in 1 / wavelength; a line through those frequencies gives the band edges
    (taking low_freq_factor 1, as Llama 3 does). None when the divisors are not of that form.
    """
    inv_freq = rope_inv_freq(head_dim, theta)
    factor = float(factors.max())
    between = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if int(between.sum()) >= 2 and len(factors) == len(inv_freq):
        x = (inv_freq / (2 * math.pi))[between].double()  # 1 / wavelength
        y = ((1 / factors[between] - 1 / factor) / (1 - 1 / factor)).double()
        line = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None])
        slope, intercept = line.solution[:, 0].tolist()
        if intercept < 0 < slope:
            scaling = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": round(1 - 1 / intercept, 4),
                "original_max_position_embeddings": round(-slope / intercept),
            }
            if torch.allclose(rope_inv_freq(head_dim, theta, scaling), inv_freq / factors, 1e-4):
                return scaling
    return None


def _check_gguf(path: Path) -> tuple[gguf.GGUFReader, str]:
    """The file, open, and its architecture, after checking that it is whole and of supported
    tensor types."""
    try:
        reader = gguf.GGUFReader(path)
        architecture = str(reader.fields["general.architecture"].contents())
    except LIBRARY_ERRORS as exc:
        raise ModelFormatError(
            f"{path} is not a valid GGUF file (corrupt or truncated): {exc}"
        ) from exc
    unsupported = sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type not in SUPPORTED_GGML_TYPES}
    )
    if unsupported:
        names = ", ".join(sorted(t.name for t in SUPPORTED_GGML_TYPES))
        raise ModelFormatError(
            f"{path} uses unsupported quantisation type(s) {', '.join(unsupported)}; "
            f"supported: {names}"
        )
    return reader, architecture
