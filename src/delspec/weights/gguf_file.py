"""A GGUF file read in place: config and tokenizer from its metadata, tensors from the file.

On first use the file's header is parsed once (`gguf_header`) into a small cache entry: the
`config.json` and tokenizer files transformers' GGUF support makes of it (with the RoPE scaling
that transformers' GGUF reader drops, and the tokenizer's light form, `tokenizer`), and an index
of the tensors (type, shape, where they lie, the Hugging Face name transformers gives them and
how transformers' GGUF loader changes their values). Later loads read that entry and, tensor by
tensor, the bytes they need from the file. Nothing in the cache is a copy of the weights.

transformers makes the entry; reading it does not import transformers, but for a tensor whose
values transformers' loader changes in a way other than `Change` (`GGUFFile.get`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from torch import Tensor

from delspec.cache import build_once, cache_dir, file_key
from delspec.errors import LIBRARY_ERRORS, ModelFormatError
from delspec.model.architectures import FAMILIES, ModelConfig, config_from_hf
from delspec.model.modules import rope_inv_freq
from delspec.weights.checkpoint import checkpoint_names, strip_prefix
from delspec.weights.gguf_header import GGUFHeader, read_header
from delspec.weights.tokenizer import write_light_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

# GGUF architectures transformers' GGUF tables lack, read as the layout whose metadata keys and
# tensor order llama.cpp's converter gives them: (that layout, config values the file cannot
# say). llama.cpp runs SmolLM3 without RoPE on every 4th layer, a step no metadata key holds.
AS_LAYOUT: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm3": (
        "llama",
        {"model_type": "smollm3", "no_rope_layer_interval": 4, "pad_token_id": None},
    ),
    "granite": ("llama", {"model_type": "granite"}),
    # rotate-half RoPE as llama.cpp runs it (no per-head reordering), Qwen2's metadata keys
    "olmo2": ("qwen2", {"model_type": "olmo2"}),
}
# Metadata transformers' GGUF table for an architecture lacks or drops: {metadata key after
# "<arch>.": config field}.
OWN_KEYS: dict[str, dict[str, str]] = {
    "phi3": {"attention.sliding_window": "sliding_window"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "granite": {
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "attention.scale": "attention_multiplier",
        "logit_scale": "logits_scaling",
    },
}

INDEX = "gguf-tensors.json"  # in the cache entry: the file's tensors
# ...and its tokenizer scores, where it has them (float32, as stored): every load that drafts
# from a pruned vocabulary ranks tokens by them, and reading them from the header parses every
# token's text too
TOKEN_SCORES = "token-scores.npy"
# ...and beside them, per token, whether it is one character of the byte range
# (`byte_character`): the scores rank those last in a SentencePiece BPE vocabulary
BYTE_CHARACTERS = "byte-characters.npy"
WORD_START = "\u2581"  # SentencePiece's mark of a space before a word
# ggml tensor types that the gguf package dequantises (floats, legacy, K- and I-quants).
_T = gguf.GGMLQuantizationType
SUPPORTED_GGML_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
    | {_T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S}
    | {_T.IQ4_NL, _T.IQ4_XS}
)


@dataclass(frozen=True)
class Change:
    """What transformers' GGUF loader does to a tensor's values: takes its rows (its values, in
    one dimension) in the order `rows` (None: as stored), then adds `add`."""

    rows: tuple[int, ...] | None
    add: float

    def apply(self, values: np.ndarray) -> np.ndarray:
        if self.rows is not None:
            values = values[list(self.rows)]
        return values + np.float32(self.add) if self.add else values


# a tensor's change that only transformers' tensor processor makes (`GGUFFile.get`)
BY_TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file and what transformers calls it."""

    qtype: gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # numpy order: the last is the values per row
    offset: int  # bytes from the start of the file
    nbytes: int
    hf_name: str | None  # transformers' name of it (with prefix); None when it is not loaded
    # what transformers' GGUF loader does to its values: nothing (None), a `Change`, or what
    # only its tensor processor does (BY_TRANSFORMERS)
    change: Change | str | None

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
        self.directory = build_once(_entry(path), path, lambda out: _describe(path, out))
        try:
            index = json.loads((self.directory / INDEX).read_text())
            self.architecture: str = index["architecture"]
            self.tensors = {
                name: TensorInfo(
                    _T(t["type"]), tuple(t["dims"]), *t["at"], t["hf"], _change(t["change"])
                )
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
        """Tensor `name`'s bytes as stored, uint8 `[rows, row bytes]`: a private (copy-on-write)
        map of the file, so its pages are read as used and leave with the array (keep a copy,
        not the array, or they stay resident)."""
        info = self.tensors[name]
        try:
            mapped = np.memmap(self.path, np.uint8, "c", info.offset, (info.nbytes,))
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"cannot read tensor {name} of {self.path}: {exc}") from exc
        return np.asarray(mapped).reshape(info.rows, -1)  # an ndarray: numpy's memmap is slow

    def get(self, hf_name: str) -> Tensor:
        """The float32 values of the tensor transformers names `hf_name` (prefix-free), exactly
        as transformers' GGUF loader gives them (its per-architecture reordering applied)."""
        name = self.names[hf_name]
        info = self.tensors[name]
        values = gguf.dequantize(self.raw(name), info.qtype).reshape(info.dims)
        if isinstance(info.change, Change):
            values = info.change.apply(values)
        elif info.change is not None:
            processor = _processor(self.architecture)(config=self._config)
            values = processor.process(weights=values, name=name).weights
        return torch.from_numpy(np.copy(values))


def _entry(path: Path) -> Path:
    """The cache entry of GGUF file `path` (named apart from the converted checkpoints of
    earlier versions, which it replaces)."""
    return cache_dir() / "gguf" / f"{path.stem}-{file_key(path)}-metadata"


def token_scores(path: Path) -> np.ndarray | None:
    """GGUF file `path`'s `tokenizer.ggml.scores` (None where it has none): from its cache entry
    where it has one (which holds them wherever the file does), else from its header."""
    entry = _entry(path)
    if (entry / INDEX).is_file():
        stored = entry / TOKEN_SCORES
        return np.load(stored) if stored.is_file() else None
    scores = read_header(path).metadata.get("tokenizer.ggml.scores")
    return None if scores is None else np.asarray(scores, dtype=np.float32)


def _describe(path: Path, out: Path) -> None:
    """Write the cache entry of GGUF file `path` into directory `out`."""
    header = _check_gguf(path)
    architecture = header.architecture
    print(f"delspec: reading {path.name}'s metadata (first load only)", file=sys.stderr, flush=True)
    config = _hf_config(path, header)
    ours = config_from_hf(config.to_dict())  # refuses unsupported families
    _carry_rope_scaling(path, header, architecture, ours.head_dim, config)
    hf_names = _hf_names(ours, architecture)
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    try:
        # the class AutoTokenizer picks for this config when no tokenizer class is declared
        tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
        with _readable(architecture):
            tokenizer = tokenizer_class.from_pretrained(path.parent, gguf_file=path.name)
        config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        write_light_tokenizer(out)
    except LIBRARY_ERRORS as exc:
        raise ModelFormatError(f"cannot read {path}'s metadata: {exc}") from exc
    # what `GGUFFile.get` hands transformers' tensor processor
    processor = _processor(architecture)(config=json.loads((out / "config.json").read_text()))
    tensors = {
        t.name: {"type": t.qtype, "dims": list(t.dims), "at": [t.offset, t.nbytes]}
        | {"hf": hf_names.get(t.name)}
        | {"change": _probe(processor, t.name, t.dims) if t.name in hf_names else None}
        for t in header.tensors.values()
    }
    (out / INDEX).write_text(json.dumps({"architecture": architecture, "tensors": tensors}))
    scores = header.metadata.get("tokenizer.ggml.scores")
    if scores is not None:
        np.save(out / TOKEN_SCORES, np.asarray(scores, dtype=np.float32))
        pieces = header.metadata.get("tokenizer.ggml.tokens", [])
        np.save(out / BYTE_CHARACTERS, np.array([byte_character(p) for p in pieces], dtype=bool))


def byte_character(piece: str) -> bool:
    """Whether token `piece` is one character of the byte range (code point below 256: digits,
    punctuation, spaces, Latin letters), SentencePiece's word-start mark read as a space."""
    return len(piece) == 1 and ord(piece.replace(WORD_START, " ")) < 256


def byte_characters(path: Path) -> np.ndarray:
    """Per token id of GGUF file `path`, whether it is a `byte_character`: from its cache entry
    where that holds them (files with token scores), else from its header."""
    stored = _entry(path) / BYTE_CHARACTERS
    if stored.is_file():
        return np.load(stored)
    pieces = read_header(path).metadata.get("tokenizer.ggml.tokens", [])
    return np.array([byte_character(p) for p in pieces], dtype=bool)


def _probe(processor: TensorProcessor, name: str, dims: tuple[int, ...]) -> Any:
    """What transformers' tensor `processor` does to the values of tensor `name` of `dims`, as
    the index stores it (`_change` reads it back): None (nothing), `Change`'s fields, or
    BY_TRANSFORMERS. Asked of distinct values, one per row: processors act on whole rows."""
    shape = dims if len(dims) == 1 else (*dims[:-1], 1)
    probe = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) + 0.5
    try:
        out = np.asarray(processor.process(weights=probe.copy(), name=name).weights)
    except LIBRARY_ERRORS:  # a processor that needs the tensor's own shape
        return BY_TRANSFORMERS
    if out.shape == probe.shape and np.array_equal(out, probe):
        return None
    if out.shape != probe.shape or out.dtype != probe.dtype:
        return BY_TRANSFORMERS
    rows, column = np.arange(shape[0]), out.reshape(shape[0], -1)[:, 0]
    add = float(column.min() - probe.flat[0])  # the lowest value came from some row
    order = np.rint(column - np.float32(add) - probe.flat[0]).astype(np.int64)
    change = Change(None if np.array_equal(order, rows) else tuple(order.tolist()), add)
    if not np.array_equal(np.sort(order), rows) or not np.array_equal(change.apply(probe), out):
        return BY_TRANSFORMERS
    return {"rows": None if change.rows is None else list(change.rows), "add": add}


def _change(stored: Any) -> Change | str | None:
    """A tensor's change as the index stores it (`_probe`)."""
    if isinstance(stored, dict):
        rows = stored["rows"]
        return Change(None if rows is None else tuple(rows), float(stored["add"]))
    if stored is not None and stored != BY_TRANSFORMERS:
        raise ValueError(f"unknown change {stored!r}")
    return stored


def _hf_config(path: Path, header: GGUFHeader) -> PretrainedConfig:
    """The transformers config of GGUF file `path` (its `header`): what transformers' GGUF loader
    (`load_gguf_checkpoint`) makes of its metadata, for the architectures delspec runs, built
    from the same mapping tables without that loader's slow reader."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = header.architecture
    name = str(header.metadata.get("general.name", ""))
    renamed = "mistral" if "llama" in architecture and "mistral" in name else architecture
    renamed, extra = AS_LAYOUT.get(architecture, (renamed, {}))
    own_keys = OWN_KEYS.get(architecture, {})
    values: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(renamed, {}))
    values["tie_word_embeddings"] = "output.weight" not in header.tensors
    for key, value in header.metadata.items():
        own = key.startswith(f"{architecture}.") and own_keys.get(key[len(architecture) + 1 :])
        prefix, _, rest = key.replace(architecture, renamed).partition(".")
        target = own or GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        if isinstance(value, np.ndarray | list):
            value = value.tolist() if isinstance(value, np.ndarray) else value
            value = value[0] if len(value) == 1 else value
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, renamed)
        values[target] = value
    key_length = header.metadata.get(f"{architecture}.attention.key_length")
    if key_length is not None and "head_dim" not in values:  # Qwen3's differs from hidden / heads
        values["head_dim"] = int(key_length)
    rotated = header.metadata.get(f"{architecture}.rope.dimension_count")
    if rotated is not None and "hidden_size" in values and "num_attention_heads" in values:
        head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
        if int(rotated) < head_dim:  # Phi-4-mini: part of each head
            values["partial_rotary_factor"] = int(rotated) / head_dim
    if values.get("model_type") == "gemma3":  # the file holds the text model alone
        values["model_type"] = "gemma3_text"
    if architecture == "olmo2" and f"{architecture}.attention.sliding_window" in header.metadata:
        raise ModelFormatError(
            f"{path.name}: sliding-window layers in an olmo2 file (OLMo 3) are not supported"
        )
    if architecture == "gemma2":  # no key for the query scale: llama.cpp's rule (27B: 46 layers)
        wide = values.get("num_hidden_layers") == 46
        heads = values.get("num_attention_heads", 1)
        values["query_pre_attn_scalar"] = (
            values["hidden_size"] // heads if wide else values.get("head_dim", 256)
        )
    values |= {
        key: value for key, value in extra.items() if key not in values or key == "model_type"
    }
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in values and tokens is not None:
        values["vocab_size"] = len(tokens)
    if renamed not in GGUF_CONFIG_MAPPING or values.get("model_type") not in FAMILIES:
        known = ", ".join(sorted({family.gguf for family in FAMILIES.values()}))
        raise ModelFormatError(
            f"unsupported architecture {architecture!r} in {path}; delspec runs GGUF files of: "
            f"{known} (delspec info --families)"
        )
    try:
        return AutoConfig.for_model(**values)
    except LIBRARY_ERRORS as exc:
        raise ModelFormatError(f"cannot read {path}'s metadata: {exc}") from exc


def gguf_layout(architecture: str) -> str:
    """The GGUF architecture whose metadata and tensor order a file of `architecture` has."""
    return AS_LAYOUT[architecture][0] if architecture in AS_LAYOUT else architecture


def _processor(architecture: str) -> type[TensorProcessor]:
    """transformers' tensor processor of a GGUF architecture (or of the layout it is read as)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(gguf_layout(architecture), TensorProcessor)


@contextlib.contextmanager
def _readable(architecture: str) -> Iterator[None]:
    """While transformers' GGUF reader reads a file of `architecture` (its tokenizer): an
    architecture read as another layout counts as supported there."""
    from transformers import modeling_gguf_pytorch_utils as gguf_pytorch_utils

    supported = gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES
    added = architecture in AS_LAYOUT and architecture not in supported
    if added:
        supported.append(architecture)
    try:
        yield
    finally:
        if added:
            supported.remove(architecture)


def _hf_names(config: ModelConfig, architecture: str) -> dict[str, str]:
    """GGUF tensor name: the name transformers gives it (with prefix), for the weights a model of
    `config` is made of (`checkpoint_names`), by the gguf package's name table of `architecture`
    (transformers' own GGUF reader renames none of these families' weights)."""
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    table = gguf.get_tensor_name_map(arch, config.num_layers)
    names = {}
    for name in checkpoint_names(config):
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.{suffix}", hf_name)
    return names


def _carry_rope_scaling(
    path: Path, header: GGUFHeader, architecture: str, head_dim: int, config: Any
) -> None:
    """Put GGUF file `path`'s RoPE scaling (read from its `header`) into transformers `config`,
    whose GGUF reader drops it.

    llama.cpp writes linear scaling as `{arch}.rope.scaling.type`/`.factor`, Llama 3 scaling
    as a `rope_freqs` tensor of per-frequency divisors (the `llama3` parameters that give those
    divisors are fitted back from them), and longrope as `rope_factors_short`/`_long` tensors
    with the original context length and attention factor. Scaling applies to
    global-attention layers.
    """
    kind = str(header.metadata.get(f"{architecture}.rope.scaling.type", "none"))
    factors = header.tensors.get("rope_freqs.weight")
    short, long = (header.tensors.get(f"rope_factors_{n}.weight") for n in ("short", "long"))
    params = copy.deepcopy(config.rope_parameters)
    target = params.get("full_attention", params)  # Gemma 3: per attention type
    if short is not None and long is not None:  # longrope (Phi-3/4 128k)
        original = header.metadata[f"{architecture}.rope.scaling.original_context_length"]
        read = [
            np.fromfile(path, np.float32, t.nbytes // 4, offset=t.offset) for t in (short, long)
        ]
        target.update(
            rope_type="longrope",
            short_factor=read[0].tolist(),
            long_factor=read[1].tolist(),
            original_max_position_embeddings=int(original),
        )
        attention = header.metadata.get(f"{architecture}.rope.scaling.attn_factor")
        if attention is not None:
            target["attention_factor"] = float(attention)
    elif factors is not None:
        count = factors.nbytes // 4
        values = np.fromfile(path, dtype=np.float32, count=count, offset=factors.offset)
        scaling = _llama3_scaling(torch.from_numpy(values), head_dim, target["rope_theta"])
        if scaling is None:
            raise ModelFormatError(
                f"{path}: its RoPE frequency factors (rope_freqs) are not Llama 3 scaling"
            )
        target.update(scaling)
    elif kind == "linear":
        factor = header.metadata[f"{architecture}.rope.scaling.factor"]
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
    """The number of layers GGUF file `path` declares: from its cache entry where it has one,
    else from its header (checked as a load checks it)."""
    config = _entry(path) / "config.json"
    if config.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return config_from_hf(json.loads(config.read_text())).num_layers
    header = _check_gguf(path)
    return int(header.metadata[f"{header.architecture}.block_count"])


def _check_gguf(path: Path) -> GGUFHeader:
    """The file's header, after checking that the file is whole and of supported tensor types."""
    header = read_header(path)
    unsupported = sorted(
        {
            _type_name(t.qtype)
            for t in header.tensors.values()
            if t.qtype not in SUPPORTED_GGML_TYPES
        }
    )
    if unsupported:
        names = ", ".join(sorted(t.name for t in SUPPORTED_GGML_TYPES))
        raise ModelFormatError(
            f"{path} uses unsupported quantisation type(s) {', '.join(unsupported)}; "
            f"supported: {names}"
        )
    return header


def _type_name(qtype: int) -> str:
    """The name of ggml tensor type `qtype`, or its number if `gguf` does not know it."""
    try:
        return _T(qtype).name
    except ValueError:
        return f"type {qtype}"
