"""Tiny random-weight models for unit tests (built in memory, no files)."""

from __future__ import annotations

import torch

from delspec.architectures import ModelConfig
from delspec.model import Transformer, build_model


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
    **overrides,
) -> Transformer:
    """A random model; with `shallow=k`, layers k.. barely change the residual stream, so early
    exits at or after layer k agree with the final layer most of the time (drafts get accepted).
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
    return model
