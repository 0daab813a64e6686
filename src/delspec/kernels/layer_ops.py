"""A layer's small per-row operations in one compiled call each (`layer_ops.c`): RMS norm and the
gated activation of the MLP, for float32 on CPU. Rows are exact whatever their number."""

from __future__ import annotations

import torch
from torch import Tensor

from delspec.kernels.build import library


def available(x: Tensor) -> bool:
    """Whether the compiled layer kernels (these and `attention`'s) can take `x`: float32 on
    CPU, with the kernels built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and library() is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """`x / rms(x) * (offset + weight)` over the last dimension, rms = sqrt(mean(x^2) + eps)."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape)
    library().dl_rms_norm(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), eps, offset, rows.shape[0], dim,
        out.data_ptr(), dim,
    )  # fmt: skip
    return out.view(x.shape)


def gated(gate_up: Tensor, gelu: bool) -> Tensor:
    """`act(gate) * up` of a fused projection `[..., 2 * width]` (gate first) -> `[..., width]`:
    SiLU, or GELU with the tanh approximation."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width).contiguous()
    out = torch.empty(rows.shape[0], width)
    library().dl_gated(rows.data_ptr(), rows.shape[0], width, int(gelu), out.data_ptr())
    return out.view(*gate_up.shape[:-1], width)
