"""The modules a `Transformer` is made of: `Linear` (computed by the product kernel chosen for its
size, on float weights or GGUF blocks), `RMSNorm`, RoPE, grouped-query `Attention` over a KV
cache, the gated `MLP`, and the `Block` (pre-norm attention and MLP, optional sandwich norms).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from delspec.errors import ModelFormatError
from delspec.kernels import attention, layer_ops
from delspec.kernels.blocks import BlockWeight
from delspec.kernels.products import (
    BLOCK_KERNELS,
    FLOAT_KERNELS,
    Int8Weight,
    narrow_product,
    packed_product,
    prepack,
    prepackable,
    row_bucket,
)
from delspec.model.architectures import ModelConfig


class Linear(nn.Linear):
    """`nn.Linear` computed by one of the product kernels of `delspec.kernels.products`:
    the one measured fastest on this machine for the product's row count (`kernels`, set by
    `delspec.machine.kernel_choice`), plain `F.linear` (or the block kernel) until measured. With
    `blocks` (a `BlockWeight`, which then replaces `weight`) the products run on GGUF blocks.
    Derived copies of a float weight (oneDNN-prepacked, int8) are made on first use and again
    whenever the weight changes; `forward(x, int8=True)` uses the int8 copy (drafts only).
    """

    blocks: BlockWeight | None = None
    kernels: dict[int, str] | None = None  # per row bucket (`row_bucket`): the kernel chosen

    def forward(self, x: Tensor, int8: bool = False) -> Tensor:
        if int8 and self.blocks is None:
            out = self.int8_weight()(x)
            return out if self.bias is None else out + self.bias
        kernel = self.kernels.get(row_bucket(x.numel() // x.shape[-1])) if self.kernels else None
        return self.compute(x, kernel)

    def candidates(self, x: Tensor) -> tuple[str, ...]:
        """The kernels that can compute this layer's product with `x`. Block weights have one
        at every size: its rows are exact whatever their number, which is what makes a
        verification of k tokens agree with k plain steps (no other kernel may take over for
        some sizes, since a verification can be as long as a draft)."""
        if self.blocks is not None:
            return BLOCK_KERNELS
        return FLOAT_KERNELS if prepackable(x, self.weight) else FLOAT_KERNELS[:2]

    def compute(self, x: Tensor, kernel: str | None = None) -> Tensor:
        """The product through `kernel` (one of `candidates`; None: the default)."""
        if self.blocks is not None:
            out = self.blocks(x)
        elif kernel == "narrow":
            out = narrow_product(x, self.weight)
        elif kernel == "packed" and prepackable(x, self.weight):
            out = packed_product(x, self._copy("packed", prepack))
        else:
            out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias

    def drop_copy(self, kind: str) -> None:
        """Free a derived copy of the weight ("packed" or "int8"), if made."""
        self.__dict__.get("_copies", {}).pop(kind, None)

    def int8_weight(self) -> Int8Weight | BlockWeight:
        """The int8 copy of the weight (made now if missing or stale); block weights are
        their own cheap copy."""
        if self.blocks is not None:
            return self.blocks
        return self._copy("int8", Int8Weight)

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles leave the derived copies out
        return {k: v for k, v in self.__dict__.items() if k != "_copies"}

    def _copy(self, kind: str, make: Callable[[Tensor], Any]) -> Any:
        copies = self.__dict__.setdefault("_copies", {})
        weight = self.weight  # inference tensors have no version counter (nor in-place edits)
        key = (weight.device, weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        cached = copies.get(kind)
        if cached is None or cached[0] != key:
            copies.pop(kind, None)  # free the stale copy first
            cached = copies[kind] = (key, make(self.weight.detach()))
        return cached[1]


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32 at least, as the reference implementations do.

    The scale is `offset + weight`, with `weight` as stored in Hugging Face checkpoints. With an
    offset (Gemma) it is applied before casting back to the input dtype, otherwise after.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if layer_ops.available(x):  # one compiled call (torch's rms_norm is several ops)
            return layer_ops.rms_norm(x, self.weight, self.eps, self.offset)
        if x.dtype in (torch.float32, torch.float64):  # one fused kernel, the same arithmetic
            scale = self.weight + self.offset if self.offset else self.weight
            return F.rms_norm(x, scale.shape, scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.to(xf.dtype))).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rms_norm(config: ModelConfig, dim: int) -> RMSNorm:
    """An `RMSNorm` of `dim` features with the family's epsilon and weight offset."""
    return RMSNorm(dim, config.rms_eps, config.spec.norm_offset)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> Tensor:
    """Inverse RoPE frequencies (float32, as transformers computes them) of `head_dim` rotated
    values, with `scaling` (a transformers `rope_scaling` dict: linear, llama3, or longrope's
    short factors: see `config_from_hf`) applied."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta**steps)
    inv_freq = 1.0 / (theta**steps)
    if scaling is None:
        return inv_freq
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelFormatError(
        f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope)"
    )


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What longrope multiplies its cos and sin tables by (transformers' default where the
    config gives none); 1 for every other kind."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_table(
    inv_freq: Tensor,
    length: int,
    dtype: torch.dtype,
    head_dim: int | None = None,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """cos and sin tables `[length, head_dim]` in the rotate-half layout, the rotated values'
    multiplied by `scale`. With a `head_dim` beyond twice `inv_freq`'s length, the values past
    each half's rotated ones are not rotated (cos 1, sin 0: `ModelConfig.rope_order`)."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    rest = (head_dim or 2 * len(inv_freq)) // 2 - len(inv_freq)
    if rest:
        cos = torch.cat([cos, torch.ones(length, rest)], dim=-1)
        sin = torch.cat([sin, torch.zeros(length, rest)], dim=-1)
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention with RoPE over the layer's KV cache. On CPU in float32 it is
    row-exact (`kernels.attention`): a position's result does not depend on how many positions
    are computed with it, so verification and plain steps agree bit for bit."""

    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a sliding window's length, or None
        spec = config.spec
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = Linear(self.q_size, config.hidden_size, bias=False)
        # per head, or (`qk_norm_full`) over all heads' queries and all heads' keys
        self.full_norms = spec.qk_norm_full
        q_width, k_width = (self.q_size, self.kv_size) if self.full_norms else (self.head_dim,) * 2
        self.q_norm = rms_norm(config, q_width) if spec.qk_norm else None
        self.k_norm = rms_norm(config, k_width) if spec.qk_norm else None
        self.scale = config.softmax_scale
        self.softcap = config.attn_softcap

    def forward(
        self,
        x: Tensor,
        start: int,
        cache: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        int8: bool = False,
    ) -> Tensor:
        n, end = x.shape[0], start + x.shape[0]
        qkv = self.qkv(x, int8)
        if self.full_norms:
            qkv = self._full_norms(qkv)
        if attention.available(qkv, self.head_dim):
            norms = None
            if self.q_norm is not None and not self.full_norms:
                q_norm, k_norm = self.q_norm, self.k_norm
                norms = (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.offset)
            out = attention.fused_attention(
                qkv,
                cos,
                sin,
                cache,
                start,
                self.num_heads,
                self.window,
                self.scale,
                norms,
                self.softcap,
            )
            return self.o(out, int8)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if self.q_norm is not None and not self.full_norms:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache[0, :, start:end] = k
        cache[1, :, start:end] = v
        keys, values = cache[0, :, :end], cache[1, :, :end]
        # Grouped-query attention without copying keys: fold each group's heads into rows.
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(self.num_kv_heads, group * n, self.head_dim)
        if mask is not None and group > 1:
            mask = mask.repeat(group, 1)
        if self.softcap:  # capped scores: no fused kernel takes them
            scores = q @ keys.transpose(-1, -2) * self.scale
            scores = self.softcap * torch.tanh(scores / self.softcap)
            if mask is not None:  # True: the key takes part
                scores = scores.masked_fill(~mask, float("-inf"))
            out = scores.softmax(-1) @ values
        else:  # 4-D inputs take the fused CPU kernel (3-D ones the slower reference path)
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=mask, scale=self.scale
            )
        out = out.reshape(self.num_heads, n, self.head_dim).transpose(0, 1).reshape(n, -1)
        return self.o(out, int8)

    def _full_norms(self, qkv: Tensor) -> Tensor:
        """`qkv` (the projection's own output) with its queries and its keys each normed over
        all heads' values, in place."""
        q, k = qkv[..., : self.q_size], qkv[..., self.q_size : self.q_size + self.kv_size]
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))
        return qkv


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gelu = config.spec.activation == "gelu_tanh"

    def forward(self, x: Tensor, int8: bool = False) -> Tensor:
        gate_up = self.gate_up(x, int8)
        if layer_ops.available(gate_up):
            return self.down(layer_ops.gated(gate_up, self.gelu), int8)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(gate * up, int8)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        dim, sandwich, pre = config.hidden_size, config.spec.sandwich_norm, config.spec.pre_norm
        self.attn_norm = rms_norm(config, dim) if pre else None
        self.attn = Attention(config, window)
        self.post_attn_norm = rms_norm(config, dim) if sandwich else None
        self.mlp_norm = rms_norm(config, dim) if pre else None
        self.mlp = MLP(config)
        self.post_mlp_norm = rms_norm(config, dim) if sandwich else None
        self.residual_scale = config.residual_multiplier

    def forward(self, x, start, cache, cos, sin, mask, int8=False) -> Tensor:
        a = self.attn(
            x if self.attn_norm is None else self.attn_norm(x), start, cache, cos, sin, mask, int8
        )
        a = a if self.post_attn_norm is None else self.post_attn_norm(a)
        x = x + (a if self.residual_scale == 1.0 else a * self.residual_scale)
        m = self.mlp(x if self.mlp_norm is None else self.mlp_norm(x), int8)
        m = m if self.post_mlp_norm is None else self.post_mlp_norm(m)
        return x + (m if self.residual_scale == 1.0 else m * self.residual_scale)
