"""The weights a model is held in: `native` (a GGUF file's own blocks), `int8` (float weights
quantised to 8 bits per block of 32, GGUF's Q8_0) or `float`.

`native_blocks` repacks a GGUF file's linear weights and embedding as stored, one tensor at a
time; `int8_blocks` quantises a float checkpoint's, one layer at a time. Both give the
`BlockWeight`s that `build_model` holds in place of float parameters. A layer whose tensors
have no block kernel stays in float (said once).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from delspec.errors import ConfigError, ModelFormatError
from delspec.kernels.blocks import KERNEL_TYPES, BlockWeight, kernel_type_names
from delspec.kernels.build import library
from delspec.model.architectures import ModelConfig
from delspec.model.transformer import WEIGHT_FORMATS
from delspec.weights.checkpoint import linear_parts, qkv_row_order
from delspec.weights.gguf_file import GGUFFile, gguf_layout
from delspec.weights.tensor_sources import TensorSource, progress

_Q8_0 = gguf.GGMLQuantizationType.Q8_0
# A block's GGUF tensors, in row order, for each fused linear layer (see FUSED_LINEARS).
_GGUF_PARTS = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}
_GGUF_FUSED_PARTS = _GGUF_PARTS | {"attn.qkv": ("attn_qkv",), "mlp.gate_up": ("ffn_up",)}


def resolve_weights(weights: str | None, source: Path, device: str) -> str:
    """The weight format to load `source` in: `weights`, or by default `native` for a GGUF file
    on a CPU with the compiled kernels, `float` otherwise. Raises `ConfigError` for an unknown
    format or one this device or source cannot hold."""
    gguf_file = source.suffix.lower() == ".gguf"
    on_cpu = torch.device(device).type == "cpu"
    if weights is None or weights == "auto":
        return "native" if gguf_file and on_cpu and library() is not None else "float"
    if weights not in WEIGHT_FORMATS:
        known = ", ".join([*WEIGHT_FORMATS, "auto"])
        raise ConfigError(f"unknown weight format {weights!r}; use one of {known}")
    if weights != "float" and not on_cpu:
        raise ConfigError(f"weights {weights!r} run on CPU only; use weights 'float' on {device}")
    if weights == "native" and not gguf_file:
        raise ConfigError(
            f"weights 'native' need a GGUF file ({source} is not one); use 'int8' or 'float'"
        )
    if weights != "float" and library() is None:
        raise ConfigError(
            f"weights {weights!r} need the compiled GGUF kernels, which are unavailable here; "
            "use weights 'float'"
        )
    return weights


def native_blocks(
    file: GGUFFile, config: ModelConfig, huge_pages: bool = False
) -> dict[str, BlockWeight]:
    """Block weights of the model's linear layers and embedding, repacked tensor by tensor from
    the GGUF file's own blocks (Llama's query and key rows reordered to the rotate-half layout
    the model computes in); in transparent huge pages with `huge_pages`."""
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    # llama.cpp interleaves the RoPE halves of the Llama layout (and of what it reads as one)
    permute = gguf_layout(file.architecture) == "llama"
    # heads that rotate part of their values: their rows in `qkv_row_order`, for a fused tensor
    # or its query and key parts
    partial: dict[str, Tensor] = {}
    order = qkv_row_order(config)
    if order is not None:
        q_rows = config.num_heads * config.head_dim
        k_rows = config.num_kv_heads * config.head_dim
        partial = {
            "attn_qkv": order,
            "attn_q": order[:q_rows],
            "attn_k": order[q_rows : q_rows + k_rows] - q_rows,
        }
    wanted: dict[str, list[str]] = {"embedding": ["token_embd.weight"]}
    if "output.weight" in file.tensors:
        wanted["lm_head"] = ["output.weight"]
    for i in range(config.num_layers):
        for module, parts in (
            _GGUF_FUSED_PARTS if config.spec.fused_tensors else _GGUF_PARTS
        ).items():
            wanted[f"layers.{i}.{module}"] = [f"blk.{i}.{part}.weight" for part in parts]
    blocks: dict[str, BlockWeight] = {}
    floats: set[str] = set()
    for module, names in progress(wanted.items(), len(wanted), "repacking", file.size):
        missing = [name for name in names if name not in file.tensors]
        if missing:
            raise ModelFormatError(f"{file.path} has no tensor {missing[0]!r}")
        kinds = [file.tensors[name].qtype for name in names]
        if not all(kind in KERNEL_TYPES for kind in kinds):
            floats.update(kind.name for kind in kinds if kind not in KERNEL_TYPES)
            continue
        rows = []  # per tensor, its rows in the order the model takes them
        for name in names:
            raw, part = file.raw(name), name.split(".")[-2]
            if permute and part in heads:
                rows.append(_rope_rows(raw, heads[part]))
            elif part in partial:
                rows.append(_ordered_rows(raw, partial[part]))
            else:
                rows.append([raw])
        cols, parts = file.tensors[names[0]].dims[-1], []
        # consecutive tensors of one type are repacked as one (cheaper than merging tiles)
        for kind, run in itertools.groupby(zip(kinds, rows, strict=True), key=lambda r: r[0]):
            pieces = [torch.from_numpy(piece) for _, tensor in run for piece in tensor]
            parts.append(BlockWeight.from_blocks(kind, pieces, cols, huge_pages))
        blocks[module] = BlockWeight.stack(parts)
    if floats:
        print(
            f"delspec: tensors of type {', '.join(sorted(floats))} have no block kernel "
            f"(supported: {kernel_type_names()}); their layers are kept in float",
            file=sys.stderr,
            flush=True,
        )
    return blocks


def _ordered_rows(raw: np.ndarray, order: Tensor) -> list[np.ndarray]:
    """`raw`'s rows in `order`, as views of its runs of consecutive rows (no copy)."""
    pieces, at = [], order.tolist()
    start = 0
    for i in range(1, len(at) + 1):
        if i == len(at) or at[i] != at[i - 1] + 1:
            pieces.append(raw[at[start] : at[i - 1] + 1])
            start = i
    return pieces


def _rope_rows(raw: np.ndarray, heads: int) -> list[np.ndarray]:
    """`raw`'s rows in the order that undoes llama.cpp's per-head interleaving of RoPE halves:
    per head, its even rows, then its odd rows (views, no copy)."""
    size = len(raw) // heads
    return [raw[h * size + odd : (h + 1) * size : 2] for h in range(heads) for odd in (0, 1)]


def hf_names(modules: set[str], config: ModelConfig) -> set[str]:
    """The Hugging Face weights (prefix-free names) that block weights for `modules` replace."""
    names, parts = set(), linear_parts(config.spec)
    for module in modules:
        if module == "embedding":
            names.add("embed_tokens.weight")
        elif module == "lm_head":
            names.add("lm_head.weight")
        else:
            layer, fused = module.split(".", 2)[1], module.split(".", 2)[2]
            names.update(f"layers.{layer}.{part}.weight" for part in parts[fused])
    return names


def check_layout(blocks: dict[str, BlockWeight], source: TensorSource, config: ModelConfig) -> None:
    """Check that the first layer's query and key block rows hold the values transformers
    reads from the file, in its row order (`qkv_row_order` applied), or raise
    ModelFormatError."""
    if "layers.0.attn.qkv" not in blocks:
        return
    if config.spec.fused_tensors:
        qk = (config.num_heads + config.num_kv_heads) * config.head_dim
        reference = source.get("layers.0.self_attn.qkv_proj.weight")[:qk]
    else:
        reference = torch.cat([source.get(f"layers.0.self_attn.{x}_proj.weight") for x in "qk"])
    order = qkv_row_order(config)
    if order is not None:  # the rows as the model takes them
        reference = reference[order[: len(reference)]]
    values = blocks["layers.0.attn.qkv"].dequantize()[: len(reference)]
    if not torch.allclose(values, reference.float(), rtol=1e-3, atol=1e-4):
        raise ModelFormatError(
            "the GGUF file's block layout does not match its converted weights; "
            "load it with weights 'float'"
        )


def int8_blocks(source: TensorSource, config: ModelConfig) -> dict[str, BlockWeight]:
    """Every linear layer and the embedding (and an untied LM head) of a float checkpoint,
    quantised to Q8_0 blocks (8 bits per value, one scale per 32), one layer at a time."""

    def q8(names: list[str]) -> BlockWeight:
        w = torch.cat([source.get(name) for name in names]).float().numpy()
        return BlockWeight.from_blocks(_Q8_0, torch.from_numpy(gguf.quantize(w, _Q8_0)), w.shape[1])

    wanted = {"embedding": ["embed_tokens.weight"]}
    if not config.tie_embeddings:
        wanted["lm_head"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        for module, parts in linear_parts(config.spec).items():
            wanted[f"layers.{i}.{module}"] = [f"layers.{i}.{part}.weight" for part in parts]
    for names in wanted.values():
        missing = [name for name in names if name not in source.names]
        if missing:
            raise ModelFormatError(f"weight {missing[0]!r} is missing from the checkpoint")
    items = progress(wanted.items(), len(wanted), "quantising", source.size)
    return {module: q8(names) for module, names in items}
