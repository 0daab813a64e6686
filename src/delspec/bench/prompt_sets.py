"""The prompts a bench run evaluates, and each task's calibration prompts (for sweeps)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from delspec.bench.tasks import TASKS, Prompt, load_prompts_file, load_task
from delspec.errors import ConfigError


@dataclass(frozen=True)
class PromptSet:
    """The evaluated prompts, each task's calibration prompts (for sweeps), and where they came
    from. `held_out` is False when calibration reuses evaluated prompts (a user's prompts file).
    """

    prompts: list[Prompt]
    calibration: dict[str, list[Prompt]]
    held_out: bool
    origin: dict[str, Any]

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(p.task for p in self.prompts))


def select_prompts(
    tasks: Sequence[str] | None,
    num_samples: int,
    seed: int,
    prompts_file: str | os.PathLike[str] | None = None,
    calibration: int = 0,
) -> PromptSet:
    """The prompts of `tasks` (None = all) or of a user's JSON Lines file.

    For tasks, the `calibration` prompts of each task are the ones after the first `num_samples`
    in the task's seeded order, so they are never evaluated. A prompts file's prompts are grouped
    by their ``task`` field, and the sweeps calibrate on the file's own first prompts per task.
    """
    if prompts_file is not None:
        if tasks is not None:
            raise ConfigError("give either tasks or a prompts file, not both")
        prompts = load_prompts_file(prompts_file)
        by_task: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            by_task.setdefault(prompt.task, []).append(prompt)
        return PromptSet(
            [p for group in by_task.values() for p in group],
            {task: group[:calibration] for task, group in by_task.items()} if calibration else {},
            held_out=False,
            origin={"prompts_file": str(prompts_file)},
        )
    names = list(TASKS) if tasks is None else list(dict.fromkeys(tasks))
    unknown = [name for name in names if name not in TASKS]
    if unknown or not names:
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    evaluated: list[Prompt] = []
    held_out: dict[str, list[Prompt]] = {}
    for name in names:
        pool = load_task(name, num_samples + calibration, seed)
        evaluated += pool[:num_samples]
        if calibration:
            held_out[name] = pool[num_samples:]
    origin = {"tasks": names, "num_samples": num_samples, "seed": seed}
    return PromptSet(evaluated, held_out, held_out=True, origin=origin)
