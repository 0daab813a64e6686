"""Row-exact causal attention over the KV cache (`attention.c`): each query row's result has the
same bits however many rows are computed together."""

from __future__ import annotations

import torch
from torch import Tensor

from delspec.kernels.build import library


def available(q: Tensor) -> bool:
    """Whether `row_exact_attention` can take these queries (float32 on CPU, compiled kernels)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.shape[-1] % 8 == 0
        and library() is not None
    )


def row_exact_attention(
    q: Tensor, keys: Tensor, values: Tensor, start: int, window: int | None, scale: float
) -> Tensor:
    """Attention of queries `q` `[heads, rows, dim]` at positions `start..` over the cached
    `keys`/`values` `[kv_heads, length, dim]` of positions `0..start+rows-1` (a row at position
    p sees positions `0..p`, or the last `window` of them) -> `[heads, rows, dim]`."""
    q = q.contiguous()
    out = torch.empty_like(q)
    heads, rows, dim = q.shape
    status = library().dl_attention(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        out.data_ptr(),
        heads,
        keys.shape[0],
        dim,
        rows,
        start,
        keys.stride(0),
        window or 0,
        scale,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("out of memory in attention")
    return out
