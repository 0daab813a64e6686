"""Linear weights kept in GGUF blocks, multiplied by the compiled kernels (`gguf_blocks.c`).

A `BlockWeight` is a weight `[out, in]` made of one or more parts stacked along `out` (a fused
q/k/v projection whose parts have different types), each part its file's own blocks: no float
copy is kept. Products quantise the activations to 8 bits per block of 32 and take integer dot
products; every output element has the same bits whatever the number of rows it is computed
with, so speculative verification of k tokens and k plain steps agree exactly.
"""

from __future__ import annotations

import array
import ctypes
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import torch
from torch import Tensor

from delspec.errors import ModelFormatError
from delspec.kernels.build import library
from delspec.kernels.team import TEAM

_T = gguf.GGMLQuantizationType
# The types the compiled kernels multiply (the others are dequantised at load).
KERNEL_TYPES = frozenset(
    {_T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
)
TILE = 8  # weight rows per tile (`gguf_blocks.c`)


def kernel_type_names() -> str:
    """The names of `KERNEL_TYPES`, in GGUF's order, for messages."""
    return ", ".join(t.name for t in sorted(KERNEL_TYPES))


def row_bytes(qtype: gguf.GGMLQuantizationType, cols: int) -> int:
    """Bytes one row of `cols` values takes in `qtype` (ModelFormatError if not whole blocks)."""
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % max(values, 32):  # the tiles take F16 / BF16 rows 32 values at a time
        raise ModelFormatError(
            f"a row of {cols} values is not whole {qtype.name} blocks of {max(values, 32)}"
        )
    return cols // values * size


@dataclass(frozen=True)
class Part:
    """`rows` consecutive output rows of a weight in one GGUF type, repacked in tiles of 8 rows
    (`gguf_blocks.c`): `tiles` is uint8 `[tile bytes]`, C-contiguous."""

    qtype: gguf.GGMLQuantizationType
    tiles: Tensor
    rows: int


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 Linux
_MADV_HUGEPAGE = 14


def advise_huge_pages(tensor: Tensor) -> bool:
    """Ask Linux to back `tensor`'s memory (the whole huge pages inside it) with transparent huge
    pages, before anything is written to it: a decoding step streams every weight, and with
    4 KB pages each 4 KB of it costs a TLB miss and stops the CPU's prefetcher at the page's
    edge. The first write of each huge page costs more (the kernel may compact memory to find
    one), so a load takes longer. A hint: whether it was taken (False elsewhere, or under
    `transparent_hugepage=never`)."""
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if sys.platform != "linux" or end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


class BlockWeight:
    """A linear weight `[out, in]` in GGUF blocks. See the module docstring."""

    def __init__(self, parts: list[Part], cols: int) -> None:
        for part in parts:
            expected = tile_bytes(part.qtype, part.rows, cols)
            if part.tiles.dtype != torch.uint8 or part.tiles.shape != (expected,):
                raise ModelFormatError(
                    f"{part.qtype.name} tiles of shape {tuple(part.tiles.shape)} for "
                    f"{part.rows} rows of {cols} values (need {expected} bytes)"
                )
            if not part.tiles.is_contiguous() or part.tiles.device.type != "cpu":
                raise ModelFormatError("block data must be a contiguous CPU tensor")
        self.parts = parts
        self.cols = cols
        self.rows = sum(p.rows for p in parts)
        # per part, the product's fixed arguments: type, tiles, rows, output offset (bytes)
        offsets = [sum(p.rows for p in parts[:i]) * 4 for i in range(len(parts))]
        self._calls = [
            (int(p.qtype), p.tiles.data_ptr(), p.rows, offset)
            for p, offset in zip(parts, offsets, strict=True)
        ]

    @classmethod
    def from_blocks(
        cls,
        qtype: gguf.GGMLQuantizationType,
        data: Tensor | Sequence[Tensor],
        cols: int,
        huge_pages: bool = False,
    ) -> BlockWeight:
        """One part from GGUF rows, repacked here into tiles: `data` is uint8 `[rows, row_bytes]`
        of `qtype` blocks, or several such pieces whose rows follow one another. Rows are read
        where they lie (any row stride: no copy of a file's map, nor of the pieces together).
        `huge_pages`: the tiles in transparent huge pages where Linux gives them
        (`advise_huge_pages`)."""
        qtype = gguf.GGMLQuantizationType(qtype)
        if qtype not in KERNEL_TYPES:
            raise ModelFormatError(
                f"no block kernel for GGUF type {qtype.name} (supported: {kernel_type_names()})"
            )
        width = row_bytes(qtype, cols)
        pieces = [data] if isinstance(data, Tensor) else list(data)
        for piece in pieces:
            if piece.dtype != torch.uint8 or piece.dim() != 2 or piece.shape[1] != width:
                raise ModelFormatError(
                    f"{qtype.name} block data of shape {tuple(piece.shape)} ({piece.dtype}); "
                    f"rows of {cols} values need uint8 (rows, {width})"
                )
        pieces = [
            p if p.stride(1) == 1 and p.stride(0) >= width else p.contiguous() for p in pieces
        ]
        # where each row's blocks lie (the pieces stay referenced until the repack is done)
        rows, at = torch.empty(sum(len(p) for p in pieces), dtype=torch.int64), 0
        for p in pieces:
            start, step = p.data_ptr(), max(p.stride(0), 1)  # one row: any stride
            torch.arange(start, start + len(p) * step, step, out=rows[at : at + len(p)])
            at += len(p)
        tiles = torch.empty(tile_bytes(qtype, len(rows), cols), dtype=torch.uint8)
        if huge_pages:
            advise_huge_pages(tiles)
        status = _library().dl_pack(
            int(qtype), rows.data_ptr(), len(rows), cols, tiles.data_ptr(), torch.get_num_threads()
        )
        _check(status, qtype)
        return cls([Part(qtype, tiles, len(rows))], cols)

    @classmethod
    def stack(cls, weights: list[BlockWeight]) -> BlockWeight:
        """The weights' rows one after another (same `in`); consecutive parts of one type are
        merged into one."""
        runs: list[list[Part]] = []
        for part in (p for w in weights for p in w.parts):
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        cols = weights[0].cols
        return cls([run[0] if len(run) == 1 else _merged(run, cols) for run in runs], cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return sum(p.tiles.numel() for p in self.parts)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __getitem__(self, rows: slice | Tensor) -> BlockWeight:
        """A subset of rows: a slice starting at a whole tile (views, no copy), or any slice or
        index tensor (a copy of those rows)."""
        if len(self.parts) != 1:
            raise NotImplementedError("row subsets of a weight with several parts")
        part = self.parts[0]
        if isinstance(rows, slice):
            start, stop, step = rows.indices(part.rows)
            if step == 1 and start % TILE == 0:
                count = max(stop - start, 0)
                at = tile_bytes(part.qtype, start, self.cols)
                size = tile_bytes(part.qtype, count, self.cols)
                return BlockWeight([Part(part.qtype, part.tiles[at : at + size], count)], self.cols)
            rows = torch.arange(start, stop, step)
        index = self._index(rows)
        tiles = torch.zeros(tile_bytes(part.qtype, len(index), self.cols), dtype=torch.uint8)
        _gather(part, self.cols, index, tiles, 0)
        return BlockWeight([Part(part.qtype, tiles, len(index))], self.cols)

    def dequantize(
        self, rows: Tensor | Sequence[int] | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """The float values of all rows, or of the listed ones (`[len(rows), in]`), given as a
        tensor or as a list (`_index`)."""
        if rows is None:
            out = torch.empty(self.rows, self.cols)
            start = 0
            for part in self.parts:
                self._dequantize_part(part, None, out[start : start + part.rows])
                start += part.rows
            return out.to(dtype)
        if len(self.parts) != 1:
            return self.dequantize().index_select(0, torch.as_tensor(rows).cpu()).to(dtype)
        index = self._index(rows)
        out = torch.empty(len(index), self.cols)
        self._dequantize_part(self.parts[0], index, out)
        return out if dtype == torch.float32 else out.to(dtype)

    def _index(self, rows: Tensor | Sequence[int]) -> Tensor | array.array:
        """`rows` as int64 row numbers, checked against the row count: a tensor's as a tensor, a
        list's as an `array.array`, with no torch operation (an embedding looks up a token or
        two per step, where a torch operation's fixed cost, for its checks or to make a tensor
        from the list, would outweigh the lookup)."""
        if isinstance(rows, Tensor):
            index = rows.cpu().to(torch.int64).contiguous()
            low, high = (int(index.min()), int(index.max())) if len(index) else (0, -1)
        else:
            index = array.array("q", rows)
            low, high = (min(index), max(index)) if index else (0, -1)
        if low < 0 or high >= self.rows:
            raise IndexError(f"row index out of range for {self.rows} rows")
        return index

    def _dequantize_part(self, part: Part, index: Tensor | array.array | None, out: Tensor) -> None:
        if isinstance(index, array.array):
            address = index.buffer_info()[0]
        else:
            address = None if index is None else index.data_ptr()
        status = _library().dl_dequantize(
            int(part.qtype),
            part.tiles.data_ptr(),
            self.cols,
            address,
            part.rows if index is None else len(index),
            out.data_ptr(),
            TEAM.other_threads(),
        )
        _check(status, part.qtype)

    def __call__(self, x: Tensor) -> Tensor:
        """`x @ weight.T` for float `x` of shape `[..., in]`, in `x`'s dtype."""
        flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        cols, matmul = self.cols, _library().dl_matmul
        out = torch.empty(*x.shape[:-1], self.rows)
        x_at, out_at, rows = flat.data_ptr(), out.data_ptr(), flat.numel() // cols
        shape = ("product", self.rows, cols, rows)
        threads = TEAM.threads(shape, barriers=False)
        start = time.perf_counter()
        for qtype, tiles, part_rows, offset in self._calls:  # the hot path: no more
            status = matmul(
                qtype, tiles, part_rows, cols, x_at, cols, rows, out_at + offset, self.rows, threads
            )
            if status:
                _check(status, gguf.GGMLQuantizationType(qtype))
        TEAM.report(shape, threads, time.perf_counter() - start, 0, 0)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def tile_bytes(qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> int:
    """Bytes `rows` rows of `cols` values of `qtype` take in tiles of `TILE` rows."""
    row_bytes(qtype, cols)  # refuses rows that are not whole blocks
    return _library().dl_tile_bytes(int(qtype), rows, cols)


def _merged(parts: list[Part], cols: int) -> Part:
    """One part holding the rows of `parts` (of one type) one after another."""
    qtype, rows = parts[0].qtype, sum(p.rows for p in parts)
    tiles = torch.zeros(tile_bytes(qtype, rows, cols), dtype=torch.uint8)
    first = 0
    for part in parts:
        _gather(part, cols, torch.arange(part.rows), tiles, first)
        first += part.rows
    return Part(qtype, tiles, rows)


def _gather(part: Part, cols: int, index: Tensor, tiles: Tensor, first: int) -> None:
    """Write rows `index` of `part` into `tiles` (of the same type) as rows first.."""
    status = _library().dl_gather(
        int(part.qtype), part.tiles.data_ptr(), cols, index.data_ptr(), len(index),
        tiles.data_ptr(), first,
    )  # fmt: skip
    _check(status, part.qtype)


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
