"""The product kernels a linear layer can use, `y = x @ weight.T`, and its derived weight copies.

Which kernel wins depends on the CPU, the thread count, the weight's shape and the number of
rows, so none is hard-coded: `delspec.machine.kernel_choice` times the candidates on the
machine and each `Linear` keeps the winner per row bucket (`row_bucket`). Candidates:

- float weights (`FLOAT_KERNELS`): `F.linear`; `narrow`, the same product as `weight @ x.T`
  over chunks of at most four columns, which some BLAS builds stream at a higher bandwidth than
  their matrix-vector kernel; `packed`, through a copy of the weight prepacked by oneDNN (whose
  cost barely grows with the row count; doubles the layer's float memory while kept);
- block weights (`BLOCK_KERNELS`): the compiled GGUF block kernel only, at every size (its rows
  are exact whatever their number; dequantising for long products can be faster, but a
  verification of a long draft would then differ from plain steps).

`Int8Weight` is the int8 copy of a float weight that drafts may run on.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

FLOAT_KERNELS = ("linear", "narrow", "packed")
BLOCK_KERNELS = ("blocks",)
# A product of r rows uses the kernel chosen for the first bucket >= r (the last one for more).
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 128)
_NARROW_COLUMNS = 4


def row_bucket(rows: int) -> int:
    """The bucket of `ROW_BUCKETS` whose kernel choice a product of `rows` rows uses."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return ROW_BUCKETS[-1]


def narrow_product(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight.T` as `weight @ x.T` over chunks of at most four rows of `x` (one row doubled
    to two), for float32 CPU inputs; `F.linear` otherwise. Agrees with `F.linear` to rounding."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, -1).contiguous()  # the kernel wants x.T column-major
    if rows == 1:
        flat = torch.cat([flat, flat])
    parts = [(weight @ chunk.T).T for chunk in flat.split(_NARROW_COLUMNS)]
    out = (parts[0] if len(parts) == 1 else torch.cat(parts))[:rows]
    return out.reshape(*x.shape[:-1], -1)


def prepackable(x: Tensor, weight: Tensor) -> bool:
    """Whether oneDNN can take this product with a prepacked weight (CPU, float32, no grad)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(weight: Tensor) -> Tensor:
    """A copy of float32 `weight` prepacked by oneDNN for `packed_product`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 2 * _NARROW_COLUMNS)


def packed_product(x: Tensor, packed: Tensor) -> Tensor:
    """`x @ weight.T` through the weight's prepacked copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Int8Weight:
    """A weight-only int8 copy of a linear weight: symmetric, one scale per output row.

    Products take bfloat16 activations (the fast path of `torch._weight_int8pack_mm` on CPU and
    GPU) and return the input's dtype. A quarter of float32's bytes, so a memory-bound product
    runs several times faster; results are approximate, which is all a draft needs.
    """

    def __init__(self, weight: Tensor) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.weight = (w / scale[:, None]).round().to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def __getitem__(self, rows: slice) -> Int8Weight:
        """A range of output rows (views, no copy), as `weight[rows]` would be."""
        part = copy.copy(self)
        part.weight, part.scale = self.weight[rows], self.scale[rows]
        return part

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


@functools.cache
def int8_supported(device: torch.device) -> bool:
    """Whether this torch build runs `Int8Weight` products on `device` (a tiny trial)."""
    try:
        Int8Weight(torch.ones(8, 64, device=device))(torch.ones(1, 64, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True
