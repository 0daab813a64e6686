"""Resident memory (RSS) of the bench's process, per method, from Linux's /proc.

All methods run in one process, so a method's memory is what the process's RSS *grows by*
because of it:

- ``setup_mib``: RSS growth while its generator is built and warmed up (the weights, copies and
  buffers it makes itself: a peer's own model, delspec's pruned draft heads), less what
  delspec's model grew by meanwhile (counted in ``shared_mib``). Methods sharing a backend
  (``hf``, ``hf-early-exit`` and ``hf-lookup``) count its model once, at the first.
- ``run_mib``: the most that the RSS peaked above its level just before one of the method's
  evaluated generations (KV cache, activations; sweeps' calibration runs are not counted). The
  kernel's peak-RSS counter is reset before each generation (``/proc/self/clear_refs``), so
  this is the true peak, not a sample.
- ``shared_mib``: for delspec methods, delspec's loaded model, which every delspec method uses
  and which was loaded before the bench started: the bytes of the torch tensors it holds once
  the method is set up (its weights in whatever format, the derived copies that it or an
  earlier method made on first use, such as prepacked or int8 weights, its cache;
  `tensor_bytes`); None for peers.
- ``peak_mib``: ``shared_mib + setup_mib + run_mib``, the method's own peak footprint, leaving out
  the interpreter and libraries that every method needs (in ``rss_start_mib`` of the run, with
  delspec's model).
- ``process_peak_mib``: the process's peak RSS during its generations, with everything every
  method loaded.

Growth is not allocation: memory that an allocator kept from earlier work and reuses does not
show. Figures are None off Linux, or where the peak counter cannot be reset.
"""

from __future__ import annotations

import gc
import re
import types
from pathlib import Path
from typing import Any

import torch

MIB = 2**20
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss() -> int | None:
    """The process's resident set size in bytes (None where /proc is not available)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the process's peak RSS to its current RSS; False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak() -> int | None:
    """The process's peak RSS in bytes since the last `reset_peak` (or since it started)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through its attributes and
    containers (not through functions, classes or modules)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque (e.g. mkldnn) tensor
                storages[id(obj)] = obj.numel() * obj.element_size()
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def mib(size: float | None) -> float | None:
    return None if size is None else round(size / MIB, 1)


class MethodMemory:
    """One method's RSS figures as it is set up and run (see the module docstring).

    `model` is delspec's loaded model for delspec methods (None for peers): what its tensors
    grow by during the setup (derived weight copies made on first use) counts as shared, not
    as the method's setup, and `shared` is their size once the method is set up.
    """

    def __init__(self, model: Any | None = None) -> None:
        self.model = model
        self.shared: int | None = None
        self.setup = 0
        self.run: int | None = 0
        self.process_peak: int | None = None
        self._before: int | None = None
        self._model_before = 0
        self._resettable = True

    def start_setup(self) -> None:
        self._before = rss()
        if self.model is not None:
            self._model_before = tensor_bytes(self.model)

    def end_setup(self) -> None:
        after = rss()
        model_growth = 0
        if self.model is not None:
            self.shared = tensor_bytes(self.model)
            model_growth = self.shared - self._model_before
        if self._before is not None and after is not None:
            self.setup += max(0, after - self._before - model_growth)

    def start_run(self) -> None:
        self._resettable = self._resettable and reset_peak()
        self._before = rss()

    def end_run(self) -> None:
        top = peak()
        if not self._resettable or top is None or self._before is None or self.run is None:
            self.run = None
            return
        self.run = max(self.run, top - self._before)
        self.process_peak = max(self.process_peak or 0, top)

    def as_dict(self) -> dict[str, float | None]:
        own = None if self.run is None else (self.shared or 0) + self.setup + self.run
        return {
            "shared_mib": mib(self.shared),
            "setup_mib": mib(self.setup if self.run is not None else None),
            "run_mib": mib(self.run),
            "peak_mib": mib(own),
            "process_peak_mib": mib(self.process_peak),
        }
