"""Wall-clock timing that is correct on asynchronous devices, and the key of every measurement
cached on disk."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from delspec.kernels.build import build_key, cpu_flags, cpu_name
from delspec.model.transformer import Transformer

Key = TypeVar("Key")

# A measurement stored on disk (kernel choices, a cost profile) is taken again after this long:
# the machine it describes may have changed (its load, its software) since.
MEASURED_MAX_AGE_S = 7 * 24 * 3600


def measurement_key(model: Transformer, threads: int, *extra: str) -> str:
    """The key of a measurement of `model` on this machine with `threads` threads (kernel
    choices, a cost profile): the CPU (name and flags), torch, the thread count, the model's
    shape, device, dtype and weight format, the compiled kernels' build, and what else sets
    the measurement apart (`extra`)."""
    parts = [
        cpu_name(),
        " ".join(sorted(cpu_flags())),
        torch.__version__,
        str(threads),
        repr(model.config),
        str(model.device),
        str(model.dtype),
        model.weights,
        build_key(),
        *extra,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], device: torch.device | None = None) -> float:
    """Wall seconds of one `run()`, waiting for `device`'s queued work before and after (where
    given)."""
    if device is not None:
        synchronize(device)
    start = time.perf_counter()
    run()
    if device is not None:
        synchronize(device)
    return time.perf_counter() - start


def median_seconds(
    run: Callable[[], object], repeats: int = 3, device: torch.device | None = None
) -> float:
    """Median wall time of `run()` over `repeats` runs after one untimed run (each timing
    waiting for `device`'s queued work, where given)."""
    run()
    samples = sorted(timed(run, device) for _ in range(repeats))
    return samples[len(samples) // 2]


def fastest_seconds(
    runs: dict[Key, Callable[[], object]],
    rounds: int,
    device: torch.device | None = None,
    warm: bool = True,
) -> dict[Key, float]:
    """Each run's fastest wall time over `rounds` rounds after one untimed call each (without
    `warm`: none; each timing waiting for `device`'s queued work, where given); the runs take
    turns within a round, so that a busy moment of the machine does not fall on one of them
    alone."""
    for run in runs.values() if warm else ():
        run()
    seconds = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for key, run in runs.items():
            seconds[key] = min(seconds[key], timed(run, device))
    return seconds


def settled_seconds(
    runs: dict[Key, Callable[[], object]],
    rounds: int,
    device: torch.device | None = None,
    tries: int = 3,
    tolerance: float = 1.25,
    warm: bool = True,
) -> tuple[dict[Key, float], bool]:
    """`fastest_seconds` (`warm`: its untimed calls, in the first take), taken again (at most
    `tries` times in all) until two takes agree: no
    run's fastest time in one take is more than `tolerance` times the other's. Returns each
    run's fastest time over all takes, and whether two takes agreed (False: the machine was
    busy throughout, and the times may be too high)."""
    best = fastest_seconds(runs, rounds, device, warm)
    for _ in range(tries - 1):
        again = fastest_seconds(runs, rounds, device)
        agree = all(max(again[k], best[k]) <= tolerance * min(again[k], best[k]) for k in runs)
        best = {k: min(best[k], again[k]) for k in runs}
        if agree:
            return best, True
    return best, tries <= 1
