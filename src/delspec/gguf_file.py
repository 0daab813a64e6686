"""A GGUF file read in place: config and tokenizer from its metadata, tensors from the file.

On first use the file is parsed once (the `gguf` package's reader, transformers' GGUF support)
into a small cache entry: `config.json` (with the RoPE scaling that transformers' GGUF reader
drops), the tokenizer files, and an index of the tensors (type, shape, where they lie, the
Hugging Face name transformers gives them). Later loads read that entry and, tensor by tensor,
the bytes they need from the file. Nothing in the cache is a copy of the weights.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from delspec.architectures import config_from_hf
from delspec.cache import build_once, cache_dir, file_key
from delspec.checkpoint import strip_prefix
from delspec.errors import LIBRARY_ERRORS, ModelFormatError
from delspec.modules import rope_inv_freq

INDEX = "gguf-tensors.json"  # in the cache entry: the file's tensors
# ggml tensor types that the gguf package dequantises (floats, legacy, K- and I-quants).
_T = gguf.GGMLQuantizationType
SUPPORTED_GGML_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
    | {_T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S}
    | {_T.IQ4_NL, _T.IQ4_XS}
)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file and what transformers calls it."""

    qtype: gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # numpy order: the last is the values per row
    offset: int  # bytes from the start of the file
    nbytes: int
    hf_name: str | None  # transformers' name of it (with prefix); None when it is not loaded

    @property
    def rows(self) -> int:
        return math.prod(self.dims[:-1])


class GGUFFile:
    """A GGUF file and its cache entry (`directory`: config.json, tokenizer files, index).

    `raw` (by GGUF name) and `get` (by Hugging Face name, in float) read one tensor from the
    file; nothing is kept in memory. A `tensor_sources.TensorSource`.
    """

    def __init__(self, path: Path) -> None:
        """Open `path`, parsing it into its cache entry on first use (keyed by the file's size,
        mtime and first MiB; the entry appears atomically)."""
        self.path = path
        # named apart from the converted checkpoints of earlier versions, which it replaces
        target = cache_dir() / "gguf" / f"{path.stem}-{file_key(path)}-metadata"
        self.directory = build_once(target, path, lambda out: _describe(path, out))
        try:
            index = json.loads((self.directory / INDEX).read_text())
            self.architecture: str = index["architecture"]
            self.tensors = {
                name: TensorInfo(_T(t["type"]), tuple(t["dims"]), *t["at"], t["hf"])
                for name, t in index["tensors"].items()
            }
            self._config = json.loads((self.directory / "config.json").read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFormatError(f"cannot read the cache entry {self.directory}: {exc}") from exc
        self.size = path.stat().st_size

    @cached_property
    def names(self) -> dict[str, str]:
        """The Hugging Face name (prefix-free) of each tensor transformers loads: GGUF name."""
        tensors = self.tensors.items()
        return {strip_prefix(t.hf_name): name for name, t in tensors if t.hf_name is not None}

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as stored, uint8 `[rows, row bytes]` (read, not mapped: the
        pages of a map would stay resident with the blocks made from them)."""
        info = self.tensors[name]
        try:
            data = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"cannot read tensor {name} of {self.path}: {exc}") from exc
        if data.size != info.nbytes:
            raise ModelFormatError(f"{self.path} is truncated: tensor {name} is cut short")
        return data.reshape(info.rows, -1)

    def get(self, hf_name: str) -> Tensor:
        """The float32 values of the tensor transformers names `hf_name` (prefix-free), exactly
        as transformers' GGUF loader gives them (its per-architecture reordering applied)."""
        name = self.names[hf_name]
        info = self.tensors[name]
        values = gguf.dequantize(self.raw(name), info.qtype).reshape(info.dims)
        processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=self._config)
        return torch.from_numpy(np.copy(processor.process(weights=values, name=name).weights))


def _describe(path: Path, out: Path) -> None:
    """Write the cache entry of GGUF file `path` into directory `out`."""
    reader, architecture = _check_gguf(path)
    print(f"delspec: reading {path.name}'s metadata (first load only)", file=sys.stderr, flush=True)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except LIBRARY_ERRORS as exc:  # the file is whole, so transformers cannot map it
        raise ModelFormatError(
            f"unsupported architecture {architecture!r} in {path} ({exc})"
        ) from exc
    head_dim = config_from_hf(config.to_dict()).head_dim  # refuses unsupported families
    _carry_rope_scaling(path, reader, architecture, head_dim, config)
    try:
        with torch.device("meta"):  # only its parameter names are used, to name the tensors
            skeleton = AutoModelForCausalLM.from_config(config)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
        hf_names = get_gguf_hf_weights_map(skeleton, processor)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except LIBRARY_ERRORS as exc:
        raise ModelFormatError(f"cannot read {path}'s metadata: {exc}") from exc
    tensors = {
        t.name: {
            "type": int(t.tensor_type),
            "dims": [int(d) for d in reversed(t.shape)],
            "at": [int(t.data_offset), int(t.n_bytes)],
            "hf": hf_names.get(t.name),
        }
        for t in reader.tensors
    }
    (out / INDEX).write_text(json.dumps({"architecture": architecture, "tensors": tensors}))
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


def block_count(path: Path) -> int:
    """The number of layers GGUF file `path` declares (its header alone)."""
    reader, architecture = _check_gguf(path)
    return int(reader.fields[f"{architecture}.block_count"].contents())


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
