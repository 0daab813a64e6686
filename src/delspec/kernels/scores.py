"""Rows of scores (logits) reduced to their greedy pick, its score and their logsumexp (the
pick's probability is e^(top - logsumexp)): one compiled call for all rows (`scores.c`) for
float32 on CPU, torch's operations elsewhere. The compiled call runs on the calling thread:
inside a decode step, torch's `max` and `logsumexp` over one row each wake its thread pool,
which costs more than the reduction. And a numpy row's mass for a sampled draw (`row_mass`),
compiled for float32, numpy elsewhere."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from delspec.kernels.build import library


def greedy_tokens(scores: Tensor) -> Tensor:
    """`scores.argmax(-1)` (the first of equal maxima), through numpy for float32 and float64
    on the CPU: torch's CPU argmax is slower for a few rows of a large vocabulary."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return torch.as_tensor(scores.detach().numpy().argmax(-1))
    return scores.argmax(-1)


def top_logsumexp(scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of `scores` `[rows, width]`: the position of the largest score (the first of
    equal maxima), that score, and the log of the sum of the exponentials. Each `[rows]`, on
    `scores`' device, the last two in `scores`' dtype. No columns at all: ValueError."""
    if not scores.shape[-1]:
        raise ValueError("no columns to take the largest score of")
    lib = library()
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or lib is None:
        at = greedy_tokens(scores).to(scores.device)
        return at, scores.gather(1, at[:, None])[:, 0], torch.logsumexp(scores, -1)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    rows, width = scores.shape
    at = torch.empty(rows, dtype=torch.int64)
    top, lse = torch.empty(rows), torch.empty(rows)
    lib.dl_top_logsumexp(
        scores.data_ptr(), scores.stride(0), rows, width,
        at.data_ptr(), top.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    return at, top, lse


def row_mass(row: np.ndarray, scale: float, shift: float) -> float:
    """The sum of e^(row * scale - shift) over `row`, in float64: one compiled pass over a
    float32 row (the scaling and shift in float32, as numpy computes them; the exponential
    within a few float32 roundings of numpy's), numpy elsewhere."""
    lib = library() if row.dtype == np.float32 and row.flags.c_contiguous else None
    if lib is None or row.ndim != 1:
        z = row * row.dtype.type(scale)
        return float(np.exp(z - z.dtype.type(shift)).sum(dtype=np.float64))
    return float(lib.dl_row_mass(row.ctypes.data, len(row), scale, shift))
