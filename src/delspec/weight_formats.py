"""The weights a model is held in: `native` (a GGUF file's own blocks), `int8` (float weights
quantised to 8 bits per block of 32, GGUF's Q8_0) or `float`.

`native_blocks` reads a GGUF file's linear weights and embedding as stored, through the tensor
index written when the file was converted (so the file is not parsed again); `int8_blocks`
quantises a float checkpoint's. Both give the `BlockWeight`s that `build_model` holds in place
of float parameters. A layer whose tensors have no block kernel stays in float (said once).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from delspec.architectures import ModelConfig
from delspec.checkpoint import FUSED_LINEARS
from delspec.errors import ConfigError, ModelFormatError
from delspec.kernels.blocks import KERNEL_TYPES, BlockWeight, kernel_type_names
from delspec.kernels.build import library
from delspec.model import WEIGHT_FORMATS

TENSOR_INDEX = "gguf-tensors.json"  # in a converted checkpoint: where each tensor lies in the file
_Q8_0 = gguf.GGMLQuantizationType.Q8_0
# A block's GGUF tensors, in row order, for each fused linear layer (see FUSED_LINEARS).
_GGUF_PARTS = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}


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


def write_tensor_index(reader: gguf.GGUFReader, architecture: str, path: Path) -> None:
    """Record where each of the file's tensors lies (type, rows, columns, offset, bytes)."""
    tensors = {
        t.name: {
            "type": int(t.tensor_type),
            "cols": int(t.shape[0]),
            "rows": int(np.prod(t.shape[1:], dtype=np.int64)),
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    }
    path.write_text(json.dumps({"architecture": architecture, "tensors": tensors}))


def native_blocks(gguf_path: Path, index_path: Path, config: ModelConfig) -> dict[str, BlockWeight]:
    """Block weights of the model's linear layers and embedding, as the GGUF file stores them
    (Llama's query and key rows reordered to the rotate-half layout the model computes in)."""
    try:
        index = json.loads(index_path.read_text())
        tensors, architecture = index["tensors"], index["architecture"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFormatError(f"cannot read the tensor index {index_path}: {exc}") from exc
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    permute = architecture == "llama"  # llama.cpp interleaves Llama's RoPE halves
    wanted: dict[str, list[str]] = {"embedding": ["token_embd.weight"]}
    if "output.weight" in tensors:
        wanted["lm_head"] = ["output.weight"]
    for i in range(config.num_layers):
        for module, parts in _GGUF_PARTS.items():
            wanted[f"layers.{i}.{module}"] = [f"blk.{i}.{part}.weight" for part in parts]
    blocks: dict[str, BlockWeight] = {}
    floats: set[str] = set()
    for module, names in wanted.items():
        missing = [name for name in names if name not in tensors]
        if missing:
            raise ModelFormatError(f"{gguf_path} has no tensor {missing[0]!r}")
        kinds = [gguf.GGMLQuantizationType(tensors[name]["type"]) for name in names]
        if not all(kind in KERNEL_TYPES for kind in kinds):
            floats.update(kind.name for kind in kinds if kind not in KERNEL_TYPES)
            continue
        parts = []
        for name in names:
            info = tensors[name]
            raw = np.asarray(data[info["offset"] : info["offset"] + info["bytes"]])
            raw = raw.reshape(info["rows"], -1)
            part = name.split(".")[-2]
            if permute and part in heads:
                raw = raw[_rope_order(info["rows"], heads[part])]
            kind = gguf.GGMLQuantizationType(info["type"])
            parts.append(BlockWeight.from_blocks(kind, torch.from_numpy(raw.copy()), info["cols"]))
        blocks[module] = BlockWeight.stack(parts)
    if floats:
        print(
            f"delspec: tensors of type {', '.join(sorted(floats))} have no block kernel "
            f"(supported: {kernel_type_names()}); their layers are kept in float",
            file=sys.stderr,
            flush=True,
        )
    return blocks


def _rope_order(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's per-head interleaving of RoPE halves."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def hf_names(modules: set[str]) -> set[str]:
    """The Hugging Face weights (prefix-free names) that block weights for `modules` replace."""
    names = set()
    for module in modules:
        if module == "embedding":
            names.add("embed_tokens.weight")
        elif module == "lm_head":
            names.add("lm_head.weight")
        else:
            layer, fused = module.split(".", 2)[1], module.split(".", 2)[2]
            names.update(f"layers.{layer}.{part}.weight" for part in FUSED_LINEARS[fused])
    return names


def check_layout(blocks: dict[str, BlockWeight], state: dict[str, Tensor]) -> None:
    """Check that the first layer's query and key block rows hold the converted checkpoint's
    values in its row order, or raise ModelFormatError."""
    if "layers.0.attn.qkv" not in blocks:
        return
    reference = torch.cat([state[f"layers.0.self_attn.{x}_proj.weight"] for x in "qk"]).float()
    values = blocks["layers.0.attn.qkv"].dequantize()[: len(reference)]
    if not torch.allclose(values, reference, rtol=1e-3, atol=1e-4):
        raise ModelFormatError(
            "the GGUF file's block layout does not match its converted weights; "
            "load it with weights 'float'"
        )


def int8_blocks(model_state: dict[str, Tensor], config: ModelConfig) -> dict[str, BlockWeight]:
    """Every linear layer and the embedding (and an untied LM head) of a float checkpoint,
    quantised to Q8_0 blocks (8 bits per value, one scale per 32)."""

    def q8(weights: list[Tensor]) -> BlockWeight:
        w = torch.cat(weights).float().numpy()
        return BlockWeight.from_blocks(_Q8_0, torch.from_numpy(gguf.quantize(w, _Q8_0)), w.shape[1])

    blocks = {"embedding": q8([model_state["embed_tokens.weight"]])}
    if not config.tie_embeddings:
        blocks["lm_head"] = q8([model_state["lm_head.weight"]])
    for i in range(config.num_layers):
        for module, parts in FUSED_LINEARS.items():
            blocks[f"layers.{i}.{module}"] = q8(
                [model_state[f"layers.{i}.{part}.weight"] for part in parts]
            )
    return blocks
