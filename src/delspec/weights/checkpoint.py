"""Weights named as in Hugging Face checkpoints, into a `Transformer`: which checkpoint
weights each fused linear layer is made of, loading them with every shape checked, and
`build_model`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from delspec.errors import ModelFormatError
from delspec.kernels.blocks import BlockWeight
from delspec.model.architectures import Family, ModelConfig
from delspec.model.modules import RMSNorm
from delspec.model.transformer import Transformer

# The Hugging Face weights that each fused linear layer of a block is made of, in row order.
FUSED_LINEARS = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}
# Families whose checkpoints hold q/k/v and gate/up already fused (Phi-3), in the same row order.
FUSED_IN_FILE = FUSED_LINEARS | {
    "attn.qkv": ("self_attn.qkv_proj",),
    "mlp.gate_up": ("mlp.gate_up_proj",),
}


def linear_parts(spec: Family) -> dict[str, tuple[str, ...]]:
    """Each fused linear layer's checkpoint weights (prefix-free, without `.weight`)."""
    return FUSED_IN_FILE if spec.fused_tensors else FUSED_LINEARS


def strip_prefix(name: str) -> str:
    """A Hugging Face weight name without its model prefix (`model.`, ...)."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def build_model(
    config: ModelConfig,
    state: dict[str, Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    blocks: dict[str, BlockWeight] | None = None,
    weights: str = "float",
) -> Transformer:
    """Create a `Transformer` (random init when `state` is None) in eval mode on `device`, with
    the weights in `blocks` held as blocks (see `Transformer.use_blocks`) in format `weights`."""
    with torch.device("meta"):
        model = Transformer(config)
    if blocks:
        model.use_blocks(blocks, weights)
    _materialise(model, dtype, device)
    if config.tie_embeddings and model.embed_blocks is None:
        model.lm_head.weight = model.embedding.weight
    if state is None:
        model.apply(_init_random)
    else:
        load_hf_state_dict(model, state)
    return model.eval().requires_grad_(False)


def _materialise(model: nn.Module, dtype: torch.dtype, device: str | torch.device) -> None:
    """Give each of `model`'s meta parameters uninitialised memory of `dtype` on `device`: what
    `to_empty(device=device).to(dtype)` does, without the meta path of `empty_like`, whose first
    use imports sympy (a noticeable share of a load)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            value = torch.empty(param.shape, dtype=dtype, device=device)
            module.register_parameter(name, nn.Parameter(value, param.requires_grad))


def _init_random(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding) and module.weight is not None:
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.normal_(module.bias, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.constant_(module.weight, 1.0 - module.offset)


def qkv_row_order(config: ModelConfig) -> Tensor | None:
    """The order in which a layer's fused q/k/v rows are taken from a checkpoint's (None: as
    stored): each query and key head's values in `ModelConfig.rope_order`."""
    order = config.rope_order()
    if order is None:
        return None
    heads = config.num_heads + config.num_kv_heads  # the rotated ones; then the values
    within = torch.tensor(order)
    rotated = [h * config.head_dim + within for h in range(heads)]
    values = torch.arange(heads * config.head_dim, (heads + config.num_kv_heads) * config.head_dim)
    return torch.cat([*rotated, values])


class CheckpointWeight(NamedTuple):
    """One of a model's parameters (None: held as blocks, `Transformer.use_blocks`), the Hugging
    Face checkpoint weights (prefix-free names) it is made of, in row order, the name an error
    calls it by, and the order its rows are taken in from theirs (None: as stored)."""

    param: Tensor | None
    names: tuple[str, ...]
    label: str
    rows: Tensor | None = None


def checkpoint_weights(model: Transformer) -> Iterator[CheckpointWeight]:
    """Each of `model`'s parameters as a `CheckpointWeight`; a fused q/k/v's rows are taken in
    `qkv_row_order`."""
    cfg, spec = model.config, model.config.spec
    qkv_rows = qkv_row_order(cfg)

    def one(param: Tensor | None, name: str) -> CheckpointWeight:
        return CheckpointWeight(param, (name,), name)

    yield one(model.embedding.weight, "embed_tokens.weight")
    yield one(model.norm.weight, "norm.weight")
    if not cfg.tie_embeddings:
        yield one(model.lm_head.weight, "lm_head.weight")
    mlp_norm = "pre_feedforward_layernorm" if spec.sandwich_norm else "post_attention_layernorm"
    for i, block in enumerate(model.layers):
        p = f"layers.{i}."
        for module, parts in linear_parts(spec).items():
            linear = block.get_submodule(module)
            fused = f"{parts[0].split('.')[0]}.{module.split('.')[1]}_proj"
            label = f"{p}{parts[0] if len(parts) == 1 else fused}.weight"
            rows = qkv_rows if module == "attn.qkv" else None
            yield CheckpointWeight(
                linear.weight, tuple(f"{p}{x}.weight" for x in parts), label, rows
            )
        if spec.qkv_bias:
            names = tuple(f"{p}self_attn.{x}_proj.bias" for x in "qkv")
            yield CheckpointWeight(
                block.attn.qkv.bias, names, p + "self_attn.qkv_proj.bias", qkv_rows
            )
        if spec.qk_norm:
            yield one(block.attn.q_norm.weight, p + "self_attn.q_norm.weight")
            yield one(block.attn.k_norm.weight, p + "self_attn.k_norm.weight")
        if spec.pre_norm:
            yield one(block.attn_norm.weight, p + "input_layernorm.weight")
            yield one(block.mlp_norm.weight, p + mlp_norm + ".weight")
        if spec.sandwich_norm:
            yield one(block.post_attn_norm.weight, p + "post_attention_layernorm.weight")
            yield one(block.post_mlp_norm.weight, p + "post_feedforward_layernorm.weight")


def checkpoint_names(config: ModelConfig) -> list[str]:
    """The Hugging Face checkpoint weights (prefix-free names) a model of `config` is made of."""
    with torch.device("meta"):
        model = Transformer(config)
    return [name for weight in checkpoint_weights(model) for name in weight.names]


@torch.no_grad()
def load_hf_state_dict(model: Transformer, state: dict[str, Tensor]) -> None:
    """Load weights named as in a Hugging Face checkpoint into `model`, checking every shape.
    Weights held as blocks (`Transformer.use_blocks`) are neither read nor needed."""
    state = {strip_prefix(k): v for k, v in state.items()}
    for param, names, label, rows in checkpoint_weights(model):
        if param is None:  # held as blocks
            continue
        missing = [name for name in names if name not in state]
        if missing:
            raise ModelFormatError(f"weight {missing[0]!r} is missing from the checkpoint")
        value = torch.cat([state[name] for name in names])
        if rows is not None:
            value = value[rows]
        if tuple(param.shape) != tuple(value.shape):
            raise ModelFormatError(
                f"weight {label!r} has shape {tuple(value.shape)}, "
                f"but the config implies {tuple(param.shape)}"
            )
        param.copy_(value.to(param.dtype))
