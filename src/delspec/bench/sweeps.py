"""`static-sweep` methods: the (E, d) grid they try, and the setting each task keeps.

A sweep times every setting of its grid on each task's calibration prompts (settings interleaved
per prompt, in rotated order like the methods of a run) and keeps the fastest per task.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import product
from typing import Any, TypeVar

from tqdm import tqdm

from delspec.bench.backends import Generate, timed
from delspec.bench.methods import Method
from delspec.errors import ConfigError

SWEEP_EXIT_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 3 / 4)  # of the model's layers
SWEEP_DRAFT_LENGTHS = (2, 4, 6)
SWEEP_CALIBRATION = 2  # calibration prompts per task
SWEEP_GRID_KEYS = ("exit_layer", "draft_length")
SWEEP_OPTIONS = (*SWEEP_GRID_KEYS, "calibration")  # consumed by the sweep, not the strategy

_T = TypeVar("_T")


def calibration_count(methods: Sequence[Method]) -> int:
    """Calibration prompts per task that the sweep methods need (0 without sweeps)."""
    counts = [int(m.options.get("calibration", SWEEP_CALIBRATION)) for m in methods if m.spec.sweep]
    if any(c < 1 for c in counts):
        raise ConfigError("a sweep needs calibration >= 1 prompt per task")
    return max(counts, default=0)


def sweep_grid(method: Method, num_layers: int) -> list[dict[str, int]]:
    """The (E, d) settings a sweep method tries: its `exit_layer` and `draft_length` options
    (a value or a list), by default fractions of the model's depth and a few draft lengths."""
    exits = sorted({max(1, round(num_layers * f)) for f in SWEEP_EXIT_FRACTIONS})
    defaults = {"exit_layer": exits, "draft_length": list(SWEEP_DRAFT_LENGTHS)}
    axes = []
    for key in SWEEP_GRID_KEYS:
        value = method.options.get(key, defaults[key])
        axes.append(value if isinstance(value, list) else [value])
    return [dict(zip(SWEEP_GRID_KEYS, point, strict=True)) for point in product(*axes)]


def sweep(
    grid: list[dict[str, int]],
    candidates: list[Generate],
    calibration: Mapping[str, list[list[int]]],
    max_new_tokens: int,
    bar: tqdm,
) -> tuple[dict[str, Any], dict[str, Generate]]:
    """Per task, the grid setting with the best overall tokens/s on the task's calibration
    prompts (settings interleaved per prompt), with its generator."""
    report: dict[str, Any] = {}
    chosen: dict[str, Generate] = {}
    for task, prompts in calibration.items():
        tokens = [0] * len(grid)
        seconds = [0.0] * len(grid)
        for index, ids in enumerate(prompts):
            for point in rotated(range(len(grid)), index):
                bar.set_postfix_str(f"sweep {task} {grid[point]}", refresh=False)
                output, wall = timed(candidates[point], ids, max_new_tokens)
                tokens[point] += len(output.token_ids)
                seconds[point] += wall
                bar.update()
        speeds = [t / s for t, s in zip(tokens, seconds, strict=True)]
        best = max(range(len(grid)), key=speeds.__getitem__)
        report[task] = {
            "chosen": grid[best],
            "grid": [{**p, "tokens_per_s": round(v, 3)} for p, v in zip(grid, speeds, strict=True)],
            "calibration_prompts": len(prompts),
        }
        chosen[task] = candidates[best]
    return report, chosen


def rotated(items: Sequence[_T] | range, shift: int) -> Iterator[_T]:
    """`items` starting at position `shift` (mod its length), wrapping around."""
    start = shift % len(items)
    yield from items[start:]
    yield from items[:start]
