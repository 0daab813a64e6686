"""Running a benchmark: every method on every prompt, interleaved, checked against `ar`.

For each prompt every method runs `repeats` times, in an order rotated by one place per prompt
and per repeat, so that a drift of the machine's speed falls on all methods alike; a record's
time is the median over its repeats (its output and statistics are the first run's). Each
method first runs one short untimed generation (warm-up). `static-sweep` methods first time
every (E, d) of their grid on each task's calibration prompts (interleaved the same way) and
keep the fastest per task. A method whose library is not installed is skipped, with a message.
Each method's resident memory is measured as it is set up and run (`delspec.bench.memory`).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from itertools import product
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from delspec.bench import memory
from delspec.bench.backends import BACKENDS, Backend, BackendUnavailable, Generate, Output, timed
from delspec.bench.methods import REFERENCE, Method, references, weights_of
from delspec.bench.metrics import aggregate, first_divergence, lossless_summary
from delspec.bench.tasks import TASKS, Prompt, load_prompts_file, load_task
from delspec.errors import ConfigError
from delspec.loading import LoadedModel

SWEEP_EXIT_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 3 / 4)  # of the model's layers
SWEEP_DRAFT_LENGTHS = (2, 4, 6)
SWEEP_CALIBRATION = 2  # calibration prompts per task
SWEEP_GRID_KEYS = ("exit_layer", "draft_length")
SWEEP_OPTIONS = (*SWEEP_GRID_KEYS, "calibration")  # consumed by the sweep, not the strategy
WARMUP_TOKENS = 8

_T = TypeVar("_T")


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


@dataclass
class BenchResult:
    """Everything a run measured; `aggregates` and `lossless` are derived from `records`."""

    model: dict[str, Any]
    settings: dict[str, Any]
    environment: dict[str, Any]
    methods: dict[str, dict[str, Any]]  # with each method's "memory" (RSS in MiB)
    records: list[dict[str, Any]]
    sweeps: dict[str, dict[str, Any]]
    trace: dict[str, Any] | None
    aggregates: dict[str, Any] = field(init=False)
    lossless: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        peers = {label for label, info in self.methods.items() if info["peer"]}
        self.aggregates = aggregate(self.records, list(self.methods), self.settings["tasks"])
        self.lossless = lossless_summary(self.records, peers)

    @property
    def ok(self) -> bool:
        """True when every delspec method reproduced `ar`'s tokens on every prompt."""
        return bool(self.lossless["ok"])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibration_count(methods: Sequence[Method]) -> int:
    """Calibration prompts per task that the sweep methods need (0 without sweeps)."""
    counts = [int(m.options.get("calibration", SWEEP_CALIBRATION)) for m in methods if m.spec.sweep]
    if any(c < 1 for c in counts):
        raise ConfigError("a sweep needs calibration >= 1 prompt per task")
    return max(counts, default=0)


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


def run_bench(
    lm: LoadedModel,
    methods: Sequence[Method],
    prompt_set: PromptSet,
    *,
    max_new_tokens: int = 128,
    progress: bool = True,
    command: str | None = None,
    repeats: int = 1,
) -> BenchResult:
    """Run `methods` (the first must be `ar`) on every prompt of `prompt_set`.

    `command` is the invocation recorded with the results (default: this process's argv).
    A method whose backend raises `BackendUnavailable` (its library is not installed) is left
    out, with a one-line message on stderr, and listed under ``settings["skipped"]``.

    Raises `ConfigError` for a method option its backend rejects (before any timed run).
    """
    if not methods or methods[0].label != REFERENCE:
        raise ConfigError(f"the first method must be {REFERENCE!r}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    reference_of = references(methods, lm.model.weights)
    environment = run_environment(lm, command)
    tasks = prompt_set.tasks
    encoded = {p: lm.tokenizer.encode(p.text) for p in prompt_set.prompts}
    calibration = {
        task: [lm.tokenizer.encode(p.text) for p in group]
        for task, group in prompt_set.calibration.items()
    }
    grids = {m.label: _sweep_grid(m, lm.model.num_layers) for m in methods if m.spec.sweep}
    if grids and any(not calibration.get(task) for task in tasks):
        raise ConfigError("sweep methods need calibration prompts for every task")
    longest = max(len(ids) for ids in [*encoded.values(), *calibration.values()])
    environment["rss_start_mib"] = memory.mib(memory.rss())

    backends: dict[str, Backend] = {}
    unavailable: dict[str, str] = {}  # per backend, why it cannot run
    skipped: dict[str, str] = {}  # per method label
    usage: dict[str, memory.MethodMemory] = {}
    candidates: dict[str, list[Generate]] = {}  # per method, per grid setting (else one)
    for method in methods:
        name = method.spec.backend
        usage[method.label] = memory.MethodMemory(None if method.spec.peer else lm.model)
        usage[method.label].start_setup()
        if name not in backends and name not in unavailable:
            try:
                backends[name] = BACKENDS[name](lm)
            except BackendUnavailable as exc:
                unavailable[name] = str(exc)
            else:
                if reserve := getattr(backends[name], "reserve", None):
                    reserve(longest + max_new_tokens)
        if name in unavailable:
            skipped[method.label] = unavailable[name]
            print(f"delspec: skipping {method.label}: {unavailable[name]}", file=sys.stderr)
            continue
        backend = backends[name]
        fixed = {k: v for k, v in method.options.items() if k not in SWEEP_OPTIONS}
        options = (
            [{**fixed, **setting} for setting in grids[method.label]]
            if method.spec.sweep
            else [method.options]
        )
        candidates[method.label] = [_generator(method, backend, o) for o in options]
        usage[method.label].end_setup()
    methods = [m for m in methods if m.label not in skipped]
    grids = {label: grid for label, grid in grids.items() if label not in skipped}

    runs = len(encoded) * len(methods) * repeats
    runs += sum(len(grid) * len(calibration[t]) for grid in grids.values() for t in tasks)
    bar = tqdm(total=runs, unit="gen", desc="bench", disable=not progress, file=sys.stderr)
    first = next(iter(encoded.values()))
    generators: dict[str, dict[str, Generate]] = {}  # per method, per task
    sweeps: dict[str, dict[str, Any]] = {}
    for method in methods:
        usage[method.label].start_setup()
        for generate in candidates[method.label]:
            generate(first, min(WARMUP_TOKENS, max_new_tokens))
        usage[method.label].end_setup()
        if method.spec.sweep:
            sweeps[method.label], generators[method.label] = _sweep(
                grids[method.label], candidates[method.label], calibration, max_new_tokens, bar
            )
        else:
            generators[method.label] = dict.fromkeys(tasks, candidates[method.label][0])

    records: list[dict[str, Any]] = []
    traced: dict[str, tuple[Prompt, Output]] = {}  # per DEL-like method, its longest trace
    for index, (prompt, ids) in enumerate(encoded.items()):
        firsts: dict[str, tuple[Output, int]] = {}
        times: dict[str, list[float]] = {m.label: [] for m in methods}
        for repeat in range(repeats):
            for turn, method in enumerate(_rotated(methods, index + repeat)):
                bar.set_postfix_str(f"{prompt.task} {method.label}", refresh=False)
                generate = generators[method.label][prompt.task]
                usage[method.label].start_run()
                output, seconds = timed(generate, ids, max_new_tokens)
                usage[method.label].end_run()
                times[method.label].append(seconds)
                firsts.setdefault(method.label, (output, turn))
                bar.update()
        outputs = {
            label: (output, statistics.median(times[label]), turn)
            for label, (output, turn) in firsts.items()
        }
        for label, (output, _) in firsts.items():
            if output.layers and output.trace and "alpha" in output.trace[-1]:
                best = traced.get(label)
                if best is None or len(output.trace) > len(best[1].trace or ()):
                    traced[label] = (prompt, output)
        records += _records(lm, prompt, len(ids), methods, outputs, reference_of)
    bar.close()

    return BenchResult(
        model=model_info(lm),
        settings={
            **prompt_set.origin,
            "tasks": tasks,
            "max_new_tokens": max_new_tokens,
            "prompts": len(encoded),
            "repeats": repeats,
            "calibration_held_out": prompt_set.held_out,
            "warmup_tokens": WARMUP_TOKENS,
            "skipped": skipped,
        },
        environment=environment,
        methods={m.label: _method_info(m) | {"memory": usage[m.label].as_dict()} for m in methods},
        records=records,
        sweeps=sweeps,
        trace=_plotted_trace(methods, traced),
    )


def _method_info(method: Method) -> dict[str, Any]:
    spec = method.spec
    return {
        "name": method.name,
        "backend": spec.backend,
        "strategy": spec.strategy,
        "options": dict(method.options),
        "peer": spec.peer,
        "description": spec.description,
    }


def _generator(method: Method, backend: Backend, options: Mapping[str, Any]) -> Generate:
    try:
        return backend.generator(method.spec.strategy, options)
    except ConfigError as exc:
        raise ConfigError(f"method {method.label!r}: {exc}") from exc


def _sweep_grid(method: Method, num_layers: int) -> list[dict[str, int]]:
    """The (E, d) settings a sweep method tries: its `exit_layer` and `draft_length` options
    (a value or a list), by default fractions of the model's depth and a few draft lengths."""
    exits = sorted({max(1, round(num_layers * f)) for f in SWEEP_EXIT_FRACTIONS})
    defaults = {"exit_layer": exits, "draft_length": list(SWEEP_DRAFT_LENGTHS)}
    axes = []
    for key in SWEEP_GRID_KEYS:
        value = method.options.get(key, defaults[key])
        axes.append(value if isinstance(value, list) else [value])
    return [dict(zip(SWEEP_GRID_KEYS, point, strict=True)) for point in product(*axes)]


def _sweep(
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
            for point in _rotated(range(len(grid)), index):
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


def _rotated(items: Sequence[_T] | range, shift: int) -> Iterator[_T]:
    """`items` starting at position `shift` (mod its length), wrapping around."""
    start = shift % len(items)
    yield from items[start:]
    yield from items[:start]


def _records(
    lm: LoadedModel,
    prompt: Prompt,
    prompt_tokens: int,
    methods: Sequence[Method],
    outputs: Mapping[str, tuple[Output, float, int]],
    reference_of: Mapping[str, str],
) -> list[dict[str, Any]]:
    """One record per method for `prompt`, in method order: its speed against `ar`'s, its output
    compared with that of `ar` on the same weights (`reference_of`)."""
    reference, reference_s, _ = outputs[REFERENCE]
    reference_speed = len(reference.token_ids) / reference_s
    records = []
    for method in methods:
        output, seconds, turn = outputs[method.label]
        speed = len(output.token_ids) / seconds
        expected = outputs[reference_of[method.label]][0]
        divergence = first_divergence(output.token_ids, expected.token_ids)
        prefill, decode = output.prefill_s, output.decode_s
        records.append(
            {
                "task": prompt.task,
                "prompt_id": prompt.id,
                "method": method.label,
                "turn": turn,
                "prompt_tokens": prompt_tokens,
                "new_tokens": len(output.token_ids),
                "wall_s": round(seconds, 6),
                "tokens_per_s": round(speed, 3),
                "speedup": round(speed / reference_speed, 4),
                # the prompt's forward pass and the decoding after it, apart (first run)
                "prefill_s": _round(prefill, 6),
                "decode_s": _round(decode, 6),
                "prefill_tokens_per_s": _round(prompt_tokens / prefill if prefill else None, 3),
                "decode_tokens_per_s": _round(
                    len(output.token_ids) / decode if decode else None, 3
                ),
                "lossless": divergence is None,
                "first_divergence": divergence,
                "reference": reference_of[method.label],
                "weights": weights_of(method, lm.model.weights),
                "stats": output.stats.as_dict() if output.stats else None,
                "text": lm.tokenizer.decode(output.token_ids, skip_special_tokens=True),
            }
        )
    return records


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _plotted_trace(
    methods: Sequence[Method], traced: Mapping[str, tuple[Prompt, Output]]
) -> dict[str, Any] | None:
    """The longest per-round trace of `del` (else of the first DEL-like method that ran)."""
    labels = [m.label for m in methods if m.label in traced]
    if not labels:
        return None
    label = "del" if "del" in labels else labels[0]
    prompt, output = traced[label]
    return {
        "method": label,
        "task": prompt.task,
        "prompt_id": prompt.id,
        "layers": output.layers,
        "rounds": output.trace,
    }


def model_info(lm: LoadedModel) -> dict[str, Any]:
    config = lm.model.config
    return {
        "name": lm.name,
        "source": lm.source,
        "layers": config.num_layers,
        "parameters": lm.model.parameter_count,
        "weights": lm.model.weights,
        "dtype": str(lm.model.dtype).removeprefix("torch."),
        "device": str(lm.model.device),
    }


def run_environment(lm: LoadedModel, command: str | None = None) -> dict[str, Any]:
    """Versions, machine and invocation of this run."""
    device = lm.model.device
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command or shlex.join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),
        "delspec": metadata.version("delspec"),
        "llama_cpp_python": _version("llama-cpp-python"),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
