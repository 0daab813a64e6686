"""Linear weights kept in GGUF blocks, multiplied by the compiled kernels (`gguf_blocks.c`).

A `BlockWeight` is a weight `[out, in]` made of one or more parts stacked along `out` (a fused
q/k/v projection whose parts have different types), each part its file's own blocks: no float
copy is kept. Products quantise the activations to 8 bits per block of 32 and take integer dot
products; every output element has the same bits whatever the number of rows it is computed
with, so speculative verification of k tokens and k plain steps agree exactly.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import gguf
import torch
from torch import Tensor

from delspec.errors import ModelFormatError
from delspec.kernels.build import library

_T = gguf.GGMLQuantizationType
# The types the compiled kernels multiply (the others are dequantised at load).
KERNEL_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K})


def row_bytes(qtype: gguf.GGMLQuantizationType, cols: int) -> int:
    """Bytes one row of `cols` values takes in `qtype` (ModelFormatError if not whole blocks)."""
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % values:
        raise ModelFormatError(f"a row of {cols} values is not whole {qtype.name} blocks")
    return cols // values * size


@dataclass(frozen=True)
class Part:
    """`rows` consecutive output rows of a weight in one GGUF type: `data` is uint8
    `[rows, row_bytes]`, C-contiguous."""

    qtype: gguf.GGMLQuantizationType
    data: Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]


class BlockWeight:
    """A linear weight `[out, in]` in GGUF blocks. See the module docstring."""

    def __init__(self, parts: list[Part], cols: int) -> None:
        for part in parts:
            if part.qtype not in KERNEL_TYPES:
                raise ModelFormatError(f"no block kernel for GGUF type {part.qtype.name}")
            expected = (part.rows, row_bytes(part.qtype, cols))
            if part.data.dtype != torch.uint8 or tuple(part.data.shape) != expected:
                raise ModelFormatError(
                    f"{part.qtype.name} block data of shape {tuple(part.data.shape)} "
                    f"({part.data.dtype}); {expected[0]} rows of {cols} values need "
                    f"uint8 {expected}"
                )
            if not part.data.is_contiguous() or part.data.device.type != "cpu":
                raise ModelFormatError("block data must be a contiguous CPU tensor")
        self.parts = parts
        self.cols = cols
        self.rows = sum(p.rows for p in parts)
        # per part, the product's fixed arguments: type, blocks, row stride, rows, output offset
        offsets = [sum(p.rows for p in parts[:i]) * 4 for i in range(len(parts))]
        self._calls = [
            (int(p.qtype), p.data.data_ptr(), p.data.stride(0), p.rows, offset)
            for p, offset in zip(parts, offsets, strict=True)
        ]

    @classmethod
    def from_blocks(cls, qtype: gguf.GGMLQuantizationType, data: Tensor, cols: int) -> BlockWeight:
        """One part of `qtype` blocks: `data` is uint8 `[rows, row_bytes]`."""
        return cls([Part(gguf.GGMLQuantizationType(qtype), data.contiguous())], cols)

    @classmethod
    def stack(cls, weights: list[BlockWeight]) -> BlockWeight:
        """The weights' rows one after another (same `in`); parts of one type are merged."""
        parts: list[Part] = []
        for part in (p for w in weights for p in w.parts):
            if parts and parts[-1].qtype == part.qtype:
                parts[-1] = Part(part.qtype, torch.cat([parts[-1].data, part.data]))
            else:
                parts.append(part)
        return cls(parts, weights[0].cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __getitem__(self, rows: slice | Tensor) -> BlockWeight:
        """A subset of rows: a slice (views, no copy) or index tensor (a copy of those rows)."""
        if len(self.parts) != 1:
            raise NotImplementedError("row subsets of a weight with several parts")
        part = self.parts[0]
        data = part.data[rows] if isinstance(rows, slice) else part.data[rows.cpu()]
        return BlockWeight([Part(part.qtype, data.contiguous())], self.cols)

    def dequantize(self, rows: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float values of all rows, or of the listed ones (`[len(rows), in]`)."""
        lib = _library()
        if rows is None:
            out = torch.empty(self.rows, self.cols)
            start = 0
            for part in self.parts:
                self._dequantize_part(lib, part, None, out[start : start + part.rows])
                start += part.rows
            return out.to(dtype)
        if len(self.parts) != 1:
            return self.dequantize().index_select(0, rows.cpu()).to(dtype)
        index = rows.cpu().to(torch.int64).contiguous()
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        out = torch.empty(len(index), self.cols)
        self._dequantize_part(lib, self.parts[0], index, out)
        return out.to(dtype)

    def _dequantize_part(self, lib, part: Part, index: Tensor | None, out: Tensor) -> None:
        count = part.rows if index is None else len(index)
        status = lib.dl_dequantize(
            int(part.qtype),
            part.data.data_ptr(),
            part.data.stride(0),
            self.cols,
            None if index is None else index.data_ptr(),
            count,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        _check(status, part.qtype)

    def __call__(self, x: Tensor) -> Tensor:
        """`x @ weight.T` for float `x` of shape `[..., in]`, in `x`'s dtype."""
        flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        cols, matmul = self.cols, _library().dl_matmul
        out = torch.empty(*x.shape[:-1], self.rows)
        x_at, out_at, rows = flat.data_ptr(), out.data_ptr(), flat.numel() // cols
        threads = torch.get_num_threads()
        for qtype, blocks, stride, part_rows, offset in self._calls:  # the hot path: no more
            status = matmul(
                qtype,
                blocks,
                stride,
                part_rows,
                cols,
                x_at,
                cols,
                rows,
                out_at + offset,
                self.rows,
                threads,
            )
            if status:
                _check(status, gguf.GGMLQuantizationType(qtype))
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def _library() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise ModelFormatError(
            "GGUF block weights need the compiled kernels, which are unavailable here; "
            "load the model with weights='float'"
        )
    return lib


def _check(status: int, qtype: gguf.GGMLQuantizationType) -> None:
    if status == -2:
        raise MemoryError("out of memory in a GGUF block product")
    if status != 0:
        raise ModelFormatError(f"the GGUF kernels cannot multiply this {qtype.name} weight")
