"""What batched rows cost on this machine: a batched step's seconds per batch size (and the
batch size that pays), and the attention span, the position at which a prompt row costs twice
one at position 0."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from delspec.machine.timing import fastest_seconds
from delspec.model.transformer import Transformer

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


# A larger batch pays when it gives this much more throughput than a smaller one: any real gain
# (more rows also let more requests start at once), beyond the noise of the timing.
BATCH_GAIN = 1.05


def measured_batch_seconds(
    model: Transformer, position: int = 128, rounds: int = 8
) -> dict[int, float]:
    """Seconds of a batched step of each of `BATCH_SIZES` rows at `position` tokens of context
    on this machine (the fastest of `rounds` runs, the sizes taking turns so that a busy moment
    of the machine does not fall on one of them). Empty where rows are not computed together
    (not a CPU, or no compiled layers: rows one by one)."""
    if model.device.type != "cpu":
        return {}
    with model.scratch_cache(position + 1, BATCH_SIZES[-1]), torch.inference_mode():
        if model.compiled_layers() is None:
            return {}
        steps = {size: _batched_step(model, size, position) for size in BATCH_SIZES}
        return fastest_seconds(steps, rounds)


def measured_max_batch(model: Transformer, position: int = 128, rounds: int = 8) -> int:
    """How many sequences a batched step should take on this machine: `paying_batch` of
    `measured_batch_seconds` (1 where rows are not computed together)."""
    seconds = measured_batch_seconds(model, position, rounds)
    return paying_batch(seconds) if seconds else 1


def paying_batch(seconds: dict[int, float]) -> int:
    """The smallest batch size whose step gives the most tokens per second of all the sizes
    measured, to within `BATCH_GAIN` (every size is looked at: one timed in a slow moment does
    not stop the search); `seconds`: the time of a step of each size."""
    speed = {size: size / step for size, step in seconds.items()}
    best = max(speed.values())
    return min(size for size, tokens_per_s in speed.items() if tokens_per_s * BATCH_GAIN >= best)


def _batched_step(model: Transformer, size: int, position: int) -> Callable[[], Tensor]:
    """A plain step of `size` sequences at `position`, one per cache slot."""
    ids, positions, slots = (
        torch.zeros(size, dtype=torch.long),
        [position] * size,
        list(range(size)),
    )
    return lambda: model.head(
        model.run_rows(model.embed(ids), positions, slots, 0, model.num_layers)
    )


def measured_attention_span(
    model: Transformer, rows: int = 32, far: int = 1024, rounds: int = 3
) -> float:
    """The position at which a prompt row costs twice one at position 0 (its attention reads
    every cached position before it), on this machine: `rows` rows through every layer at
    position 0 and at `far`, the fastest of `rounds` runs each. `math.inf` where a row far on
    costs no more (or the context is too short to tell)."""
    far = min(far, model.config.max_position - rows)
    if far <= 0:
        return math.inf
    with model.scratch_cache(far + rows), torch.inference_mode():
        states = model.embed(torch.zeros(rows, dtype=torch.long, device=model.device))
        runs = {
            at: lambda at=at: model.run_layers(states, at, 0, model.num_layers) for at in (0, far)
        }
        seconds = fastest_seconds(runs, rounds, model.device)
    extra = seconds[far] - seconds[0]
    return far * seconds[0] / extra if extra > 0 else math.inf
