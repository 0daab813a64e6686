"""Row-exact causal attention over the KV cache (`attention.c`), fused with the per-head query
and key norms, RoPE and the cache write: each query row's result has the same bits however many
rows are computed together."""

from __future__ import annotations

import torch
from torch import Tensor

from delspec.kernels import layer_ops
from delspec.kernels.build import library


def available(x: Tensor, head_dim: int) -> bool:
    """Whether `fused_attention` can take this projection: what the layer kernels take
    (`layer_ops.available`), with a head size that is a multiple of 8."""
    return head_dim % 8 == 0 and layer_ops.available(x)


def fused_attention(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: Tensor,
    start: int,
    heads: int,
    window: int | None,
    scale: float,
    norms: tuple[Tensor, Tensor, float, float] | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of the rows of `qkv` `[rows, (heads + 2 kv_heads) * dim]` (a fused projection:
    queries, keys, values) at positions `start..` -> `[rows, heads * dim]`.

    Their keys (RMS-normed with `norms` = (query weight, key weight, eps, offset) if given, then
    rotated by the rows' `cos`/`sin` tables `[rows, dim]`) and values are written into `cache`
    `[2, kv_heads, length, dim]` (keys and values each contiguous) first; a row at position p
    sees positions `0..p`, or the last `window` of them. Scores are `scale * q . k`, capped to
    `softcap * tanh(score / softcap)` where `softcap` is given.
    """
    _, kv_heads, _, dim = cache.shape
    rows = qkv.shape[0]
    whole = cache.stride(1) == cache.shape[2] * dim and cache.stride(2) == dim  # each of k, v
    if dim % 8 or not whole or cache.stride(3) != 1 or cache.dtype != torch.float32:
        raise ValueError("fused attention needs head_dim % 8 == 0 and a contiguous float32 cache")
    if qkv.stride(-1) != 1:  # e.g. a narrow product's transposed result
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(rows, heads * dim)
    q_norm, k_norm, eps, offset = norms if norms is not None else (None, None, 0.0, 0.0)
    status = library().dl_attention(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(),
        eps,
        offset,
        cache.data_ptr(),
        cache.data_ptr() + cache.stride(0) * 4,  # (no views: each costs microseconds)
        out.data_ptr(),
        heads,
        kv_heads,
        dim,
        rows,
        start,
        cache.stride(1),
        window or 0,
        scale,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("out of memory in attention")
    return out
