"""A model's float tensors by Hugging Face name, read one at a time when asked for: from a
checkpoint directory's safetensors files (`SafetensorsSource`) or a GGUF file
(`gguf_file.GGUFFile`), so a loader holds at most its result and the tensor in hand.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from delspec.errors import LIBRARY_ERRORS, ModelFormatError
from delspec.weights.checkpoint import strip_prefix

LARGE_BYTES = 200 * 2**20  # a model file this large shows load progress
_Item = TypeVar("_Item")


class TensorSource(Protocol):
    """Tensors by prefix-free Hugging Face name (`checkpoint.strip_prefix`)."""

    names: Mapping[str, Any]  # the tensors there are
    size: int  # bytes of the files they come from

    def get(self, name: str) -> Tensor:
        """Tensor `name`, read now; ModelFormatError if it cannot be read."""
        ...


class SafetensorsSource:
    """The safetensors file(s) of a Hugging Face checkpoint directory. Each `get` opens the
    file anew: the pages of a map that stayed open would stay resident."""

    def __init__(self, directory: Path, files: list[Path]) -> None:
        if not files:
            raise ModelFormatError(f"{directory} has no *.safetensors weights")
        self.names: dict[str, tuple[Path, str]] = {}  # name: (file, key)
        self.size = sum(file.stat().st_size for file in files)
        for file in files:
            with _opened(file) as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    self.names[strip_prefix(key)] = (file, key)

    def get(self, name: str) -> Tensor:
        file, key = self.names[name]
        with _opened(file) as handle:
            return handle.get_tensor(key)


@contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """safe_open(file), its errors reported as ModelFormatError."""
    try:
        with safe_open(file, framework="pt") as handle:
            yield handle
    except LIBRARY_ERRORS as exc:
        raise ModelFormatError(f"cannot read weights file {file}: {exc}") from exc


def progress(items: Iterable[_Item], total: int, label: str, size: int) -> Iterator[_Item]:
    """`items`, with a progress bar on a terminal's stderr when the model file is large."""
    return iter(
        tqdm(
            items,
            total=total,
            desc=label,
            unit="tensor",
            file=sys.stderr,
            leave=False,
            disable=None if size >= LARGE_BYTES else True,
        )
    )
