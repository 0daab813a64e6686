"""Tiny random-weight models for unit tests (built in memory, no files)."""

from __future__ import annotations

import gguf
import torch

from delspec.architectures import ModelConfig
from delspec.kernels.blocks import BlockWeight
from delspec.model import Linear, Transformer, build_model


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        family="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position=256,
        tie_embeddings=False,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    shallow: int | None = None,
    residual_scale: float = 0.05,
    blocks: bool = False,
    **overrides,
) -> Transformer:
    """A random model; with `shallow=k`, layers k.. barely change the residual stream, so early
    exits at or after layer k agree with the final layer most of the time (drafts get accepted).
    With `blocks`, its linear weights and embedding are then held as Q8_0 blocks (format int8).
    """
    torch.manual_seed(seed)
    model = build_model(tiny_config(**overrides), dtype=dtype)
    with torch.no_grad():  # larger weights than the init: peaked, varied predictions
        model.embedding.weight.normal_(0.0, 1.0)
        if not model.config.tie_embeddings:
            model.lm_head.weight.normal_(0.0, 1.0)
        for block in model.layers:
            block.attn.qkv.weight.normal_(0.0, 0.3)
            block.mlp.gate_up.weight.normal_(0.0, 0.3)
        if shallow is not None:
            for block in model.layers[shallow:]:
                block.attn.o.weight.mul_(residual_scale)
                block.mlp.down.weight.mul_(residual_scale)
    if blocks:
        named = {n: m.weight for n, m in model.named_modules() if isinstance(m, Linear)}
        named["embedding"] = model.embedding.weight
        if model.config.tie_embeddings:
            named.pop("lm_head")
        model.use_blocks({n: q8_0(w) for n, w in named.items()}, "int8")
    return model


def q8_0(weight: torch.Tensor) -> BlockWeight:
    """`weight` as Q8_0 blocks."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    values = weight.detach().float().numpy()
    return BlockWeight.from_blocks(
        q8_0, torch.from_numpy(gguf.quantize(values, q8_0)), values.shape[1]
    )
