"""A GGUF file's header, read in one pass without the tensor data: its metadata and tensor table.

Scalars with `struct`, numeric arrays as numpy copies of their bytes, string arrays (a
vocabulary, a merge table) decoded in one walk; nothing per element beyond that, so a 262k-token
vocabulary takes a fraction of a second (the `gguf` package's reader builds several numpy views
per element and takes tens of seconds).
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from delspec.errors import ModelFormatError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# struct codes of the fixed-size value types (u8, i8, u16, i16, u32, i32, f32, bool, u64, ...)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of the table: its ggml type (an int: the file may hold one `gguf` does not
    know), dimensions in numpy order (the last is the values per row), where its data lies."""

    name: str
    qtype: int
    dims: tuple[int, ...]
    offset: int  # bytes from the start of the file
    nbytes: int  # 0 for a type `gguf` does not know


@dataclass(frozen=True)
class GGUFHeader:
    """`metadata`: key: value (int, float, bool, str, list of str, or numpy array for a numeric
    array); `tensors`: by name, in file order."""

    metadata: dict[str, Any]
    tensors: dict[str, HeaderTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def read_header(path: Path) -> GGUFHeader:
    """The header of GGUF file `path`; ModelFormatError (one line) if it is not a whole GGUF
    file: bad magic or version, a header cut short, or tensor data past the end of the file.
    A load asks several times (its depth, its token scores): the last few files' headers are
    kept while the file is unchanged (same size and modification time). Callers must not
    modify the header's metadata."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelFormatError(f"{path} cannot be read: {exc}") from exc
    return _read_header(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            header = _parse(m)
            size = len(m)
    except (OSError, ValueError, struct.error) as exc:
        raise ModelFormatError(
            f"{path} is not a valid GGUF file (corrupt or truncated): {exc}"
        ) from exc
    for tensor in header.tensors.values():
        if tensor.offset + tensor.nbytes > size:
            raise ModelFormatError(
                f"{path} is not a valid GGUF file (corrupt or truncated): "
                f"tensor {tensor.name} ends past the end of the file"
            )
    return header


def _parse(m: mmap.mmap) -> GGUFHeader:
    if m[:4] != _MAGIC:
        raise ValueError("no GGUF magic")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", m, 4)
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version}")
    reader = _Reader(m, 24)
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("I"))
    if "general.architecture" not in metadata:
        raise ValueError("no general.architecture in its metadata")
    table = []
    for _ in range(tensor_count):
        name = reader.string()
        dims = struct.unpack_from(f"<{reader.scalar('I')}Q", m, reader.at)
        reader.at += 8 * len(dims)
        qtype, offset = reader.scalar("I"), reader.scalar("Q")
        table.append((name, qtype, tuple(int(d) for d in reversed(dims)), offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-reader.at // alignment) * alignment
    tensors = {
        name: HeaderTensor(name, qtype, dims, start + offset, _nbytes(qtype, dims))
        for name, qtype, dims, offset in table
    }
    return GGUFHeader(metadata, tensors)


def _nbytes(qtype: int, dims: tuple[int, ...]) -> int:
    """Bytes a tensor of `dims` in ggml type `qtype` takes (0 for a type gguf does not know)."""
    try:
        values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return 0
    count = int(np.prod(dims, dtype=np.int64))
    return count // values * size


class _Reader:
    """Values read one after another from `m`, starting at byte `at`."""

    def __init__(self, m: mmap.mmap, at: int) -> None:
        self.m, self.at = m, at

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.m, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.at = self.at, self.at + length
        if self.at > len(self.m):
            raise ValueError("a string runs past the end of the file")
        return self.m[start : self.at].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"metadata value of unknown type {kind}")
        element, count = self.scalar("I"), self.scalar("Q")
        if element == _STRING:
            return [self.string() for _ in range(count)]
        if element not in _SCALARS:
            raise ValueError(f"metadata array of type {element}")
        dtype = np.dtype("<" + _SCALARS[element])
        values = np.frombuffer(self.m, dtype, count, self.at).copy()
        self.at += dtype.itemsize * count
        return values
