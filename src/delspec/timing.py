"""Wall-clock timing that is correct on asynchronous devices."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

Key = TypeVar("Key")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    run: Callable[[], object], repeats: int = 3, device: torch.device | None = None
) -> float:
    """Median wall time of `run()` over `repeats` runs after one untimed run (each timing
    waiting for `device`'s queued work, where given)."""
    run()
    samples = []
    for _ in range(repeats):
        if device is not None:
            synchronize(device)
        start = time.perf_counter()
        run()
        if device is not None:
            synchronize(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def fastest_seconds(runs: dict[Key, Callable[[], object]], rounds: int) -> dict[Key, float]:
    """Each run's fastest wall time over `rounds` rounds after one untimed call each (CPU work);
    the runs take turns within a round, so that a busy moment of the machine does not fall on
    one of them alone."""
    for run in runs.values():
        run()
    seconds = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[key] = min(seconds[key], time.perf_counter() - start)
    return seconds
