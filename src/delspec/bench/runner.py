"""Running a benchmark: every method on every prompt, interleaved, checked against `ar`.

For each prompt every method runs `repeats` times, in an order rotated by one place per prompt
and per repeat, so that a drift of the machine's speed falls on all methods alike; with
`min_seconds`, more such rounds follow until every method's timings on the prompt add up to that
much (at most `MAX_REPEATS_FACTOR` times `repeats`): a reply of a few tokens takes a tenth of a
second, where three timings tell the host's moments apart more than the methods. A record's
time is the median over its timings (its output and statistics are the first run's). Each
method first runs one short untimed generation (warm-up). `static-sweep` methods first time
every (E, d) of their grid on each task's calibration prompts (interleaved the same way) and
keep the fastest per task. A method whose library is not installed is skipped, with a message.
Each method's resident memory is measured as it is set up and run (`delspec.bench.memory`).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from delspec.bench import memory
from delspec.bench.backends import BACKENDS, Backend, BackendUnavailable, Generate, Output, timed
from delspec.bench.environment import model_info, read_bandwidth, run_environment
from delspec.bench.methods import REFERENCE, Method, references, weights_of
from delspec.bench.metrics import aggregate, first_divergence, lossless_summary
from delspec.bench.prompt_sets import PromptSet
from delspec.bench.sweeps import SWEEP_OPTIONS, rotated, sweep, sweep_grid
from delspec.bench.tasks import Prompt
from delspec.decoding.generate import encode_prompt
from delspec.decoding.sampling import Sampling
from delspec.errors import ConfigError
from delspec.weights.loading import LoadedModel

WARMUP_TOKENS = 8
MAX_REPEATS_FACTOR = 4  # with `min_seconds`, at most this many times `repeats` timings a prompt


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


def run_bench(
    lm: LoadedModel,
    methods: Sequence[Method],
    prompt_set: PromptSet,
    *,
    max_new_tokens: int = 128,
    progress: bool = True,
    command: str | None = None,
    repeats: int = 1,
    min_seconds: float = 0.0,
    chat: bool = False,
    sampling: Sampling | None = None,
) -> BenchResult:
    """Run `methods` (the first must be `ar`) on every prompt of `prompt_set`; with `chat`,
    each prompt is one user message through the model's chat template (as an instruct model is
    used), for every method alike. With `sampling` (not greedy), every method samples with its
    settings, seeded per prompt with the prompt's index in the run (warm-ups and sweeps with
    0): delspec methods must still give `ar`'s tokens (the same seed gives the same text).

    `command` is the invocation recorded with the results (default: this process's argv).
    A method whose backend raises `BackendUnavailable` (its library is not installed) is left
    out, with a one-line message on stderr, and listed under ``settings["skipped"]``.

    Raises `ConfigError` for a method option its backend rejects (before any timed run).
    """
    _check_settings(methods, max_new_tokens, repeats, min_seconds)
    reference_of = references(methods, lm.model.weights)
    environment = run_environment(lm, command)
    if sampling is not None and sampling.greedy:
        sampling = None
    run = _BenchRun(lm, prompt_set, max_new_tokens, repeats, min_seconds, chat)
    run.sampling = sampling
    grids = {m.label: sweep_grid(m, lm.model.num_layers) for m in methods if m.spec.sweep}
    if grids and any(not run.calibration.get(task) for task in run.tasks):
        raise ConfigError("sweep methods need calibration prompts for every task")
    # how fast the model's weights can be read now, as a plain step reads them: a busy host
    # (another VM's work in the caches and memory) reads them slower, and speculation then
    # gains more over ar (a step reading weights slows more than one multiplying several rows)
    on_cpu, weights = lm.model.device.type == "cpu", lm.model.weight_bytes
    environment["read"] = {"bytes": weights, "gb_per_s": []}
    if on_cpu:
        environment["read"]["gb_per_s"].append(round(read_bandwidth(weights), 1))
    environment["rss_start_mib"] = memory.mib(memory.rss())
    candidates = run.set_up(methods, grids)
    methods = [m for m in methods if m.label not in run.skipped]
    grids = {label: grid for label, grid in grids.items() if label not in run.skipped}
    runs = len(run.encoded) * len(methods) * repeats
    runs += sum(len(grid) * len(run.calibration[t]) for grid in grids.values() for t in run.tasks)
    run.bar = tqdm(total=runs, unit="gen", desc="bench", disable=not progress, file=sys.stderr)
    generators, sweeps = run.warm_up_and_choose(methods, candidates, grids)
    records, traced = run.measure(methods, generators, reference_of)
    run.bar.close()
    if on_cpu:  # and at the end
        environment["read"]["gb_per_s"].append(round(read_bandwidth(weights), 1))
    return BenchResult(
        model=model_info(lm),
        settings={
            **prompt_set.origin,
            "tasks": run.tasks,
            "chat": chat,
            "sampling": None if sampling is None else _sampling_settings(sampling),
            "max_new_tokens": max_new_tokens,
            "prompts": len(run.encoded),
            "repeats": repeats,
            "min_seconds": min_seconds,
            "calibration_held_out": prompt_set.held_out,
            "warmup_tokens": WARMUP_TOKENS,
            "skipped": run.skipped,
        },
        environment=environment,
        methods={
            m.label: _method_info(m) | {"memory": run.usage[m.label].as_dict()} for m in methods
        },
        records=records,
        sweeps=sweeps,
        trace=_plotted_trace(methods, traced),
    )


def _check_settings(
    methods: Sequence[Method], max_new_tokens: int, repeats: int, min_seconds: float
) -> None:
    if not methods or methods[0].label != REFERENCE:
        raise ConfigError(f"the first method must be {REFERENCE!r}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if not 0 <= min_seconds < float("inf"):  # NaN too
        raise ConfigError(f"min_seconds must be a number >= 0, got {min_seconds}")


class _BenchRun:
    """The steps of `run_bench` and what they share: the model, the run's settings, the prompts'
    token ids (`encoded`, and per task `calibration`), each method's memory (`usage`), the
    methods left out (`skipped`, with why) and the progress bar."""

    def __init__(
        self,
        lm: LoadedModel,
        prompt_set: PromptSet,
        max_new_tokens: int,
        repeats: int,
        min_seconds: float,
        chat: bool,
    ) -> None:
        self.lm, self.max_new_tokens, self.repeats = lm, max_new_tokens, repeats
        self.min_seconds = min_seconds
        self.tasks = prompt_set.tasks
        self.encoded = {p: encode_prompt(lm, p.text, chat) for p in prompt_set.prompts}
        self.calibration = {
            task: [encode_prompt(lm, p.text, chat) for p in group]
            for task, group in prompt_set.calibration.items()
        }
        self.sampling: Sampling | None = None
        self.usage: dict[str, memory.MethodMemory] = {}
        self.skipped: dict[str, str] = {}
        self.bar: tqdm | None = None

    def set_up(
        self, methods: Sequence[Method], grids: Mapping[str, list[dict[str, int]]]
    ) -> dict[str, list[Generate]]:
        """Each method's generators (one per grid setting of a sweep, else one), on backends
        that reserve room for the longest prompt; a method whose backend is unavailable is
        skipped."""
        longest = max(len(ids) for ids in [*self.encoded.values(), *self.calibration.values()])
        backends: dict[str, Backend] = {}
        unavailable: dict[str, str] = {}  # per backend, why it cannot run
        candidates: dict[str, list[Generate]] = {}  # per method, per grid setting (else one)
        for method in methods:
            name = method.spec.backend
            self.usage[method.label] = memory.MethodMemory(
                None if method.spec.peer else self.lm.model
            )
            self.usage[method.label].start_setup()
            if name not in backends and name not in unavailable:
                try:
                    backends[name] = BACKENDS[name](self.lm)
                except BackendUnavailable as exc:
                    unavailable[name] = str(exc)
                else:
                    if reserve := getattr(backends[name], "reserve", None):
                        reserve(longest + self.max_new_tokens)
            if name in unavailable:
                self.skipped[method.label] = unavailable[name]
                print(f"delspec: skipping {method.label}: {unavailable[name]}", file=sys.stderr)
                continue
            backend = backends[name]
            fixed = {k: v for k, v in method.options.items() if k not in SWEEP_OPTIONS}
            options = (
                [{**fixed, **setting} for setting in grids[method.label]]
                if method.spec.sweep
                else [method.options]
            )
            candidates[method.label] = [
                _generator(method, backend, o, self.sampling) for o in options
            ]
            self.usage[method.label].end_setup()
        return candidates

    def warm_up_and_choose(
        self,
        methods: Sequence[Method],
        candidates: Mapping[str, list[Generate]],
        grids: Mapping[str, list[dict[str, int]]],
    ) -> tuple[dict[str, dict[str, Generate]], dict[str, dict[str, Any]]]:
        """Warm every generator up on the first prompt, then per method and task the generator
        that runs (a sweep's fastest setting on the task's calibration prompts), and the
        sweeps' reports."""
        first = next(iter(self.encoded.values()))
        generators: dict[str, dict[str, Generate]] = {}  # per method, per task
        sweeps: dict[str, dict[str, Any]] = {}
        for method in methods:
            self.usage[method.label].start_setup()
            for generate in candidates[method.label]:
                generate(first, min(WARMUP_TOKENS, self.max_new_tokens))
            self.usage[method.label].end_setup()
            if method.spec.sweep:
                sweeps[method.label], generators[method.label] = sweep(
                    grids[method.label],
                    candidates[method.label],
                    self.calibration,
                    self.max_new_tokens,
                    self.bar,
                )
            else:
                generators[method.label] = dict.fromkeys(self.tasks, candidates[method.label][0])
        return generators, sweeps

    def measure(
        self,
        methods: Sequence[Method],
        generators: Mapping[str, Mapping[str, Generate]],
        reference_of: Mapping[str, str],
    ) -> tuple[list[dict[str, Any]], dict[str, tuple[Prompt, Output]]]:
        """The timed runs, interleaved: per prompt, every method once per round in rotated
        order, `repeats` rounds and more while a method's timings add up to less than
        `min_seconds` (see the module docstring). Returns the records and, per DEL-like
        method, its longest trace."""
        records: list[dict[str, Any]] = []
        traced: dict[str, tuple[Prompt, Output]] = {}  # per DEL-like method, its longest trace
        for index, (prompt, ids) in enumerate(self.encoded.items()):
            firsts: dict[str, tuple[Output, int]] = {}
            times: dict[str, list[float]] = {m.label: [] for m in methods}
            for repeat in range(self.repeats * MAX_REPEATS_FACTOR):
                if repeat >= self.repeats:
                    if min(sum(t) for t in times.values()) >= self.min_seconds:
                        break
                    self.bar.total += len(methods)
                for turn, method in enumerate(rotated(methods, index + repeat)):
                    self.bar.set_postfix_str(f"{prompt.task} {method.label}", refresh=False)
                    generate = generators[method.label][prompt.task]
                    self.usage[method.label].start_run()
                    seed = None if self.sampling is None else index
                    output, seconds = timed(generate, ids, self.max_new_tokens, seed)
                    self.usage[method.label].end_run()
                    times[method.label].append(seconds)
                    firsts.setdefault(method.label, (output, turn))
                    self.bar.update()
            outputs = {
                label: (output, statistics.median(times[label]), turn)
                for label, (output, turn) in firsts.items()
            }
            for label, (output, _) in firsts.items():
                if output.layers and output.trace and "alpha" in output.trace[-1]:
                    best = traced.get(label)
                    if best is None or len(output.trace) > len(best[1].trace or ()):
                        traced[label] = (prompt, output)
            timings = len(times[methods[0].label])
            records += _records(self.lm, prompt, len(ids), methods, outputs, reference_of, timings)
        return records, traced


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


def _sampling_settings(sampling: Sampling) -> dict[str, Any]:
    """The run's sampling settings as recorded (the seeds: each prompt's index)."""
    keys = ("temperature", "top_k", "top_p")
    return {key: getattr(sampling, key) for key in keys} | {"seeds": "prompt index"}


def _generator(
    method: Method, backend: Backend, options: Mapping[str, Any], sampling: Sampling | None
) -> Generate:
    try:
        if sampling is None:
            return backend.generator(method.spec.strategy, options)
        return backend.generator(method.spec.strategy, options, sampling)
    except ConfigError as exc:
        raise ConfigError(f"method {method.label!r}: {exc}") from exc


def _records(
    lm: LoadedModel,
    prompt: Prompt,
    prompt_tokens: int,
    methods: Sequence[Method],
    outputs: Mapping[str, tuple[Output, float, int]],
    reference_of: Mapping[str, str],
    timings: int,
) -> list[dict[str, Any]]:
    """One record per method for `prompt`, in method order: its speed against `ar`'s (median of
    `timings` each), its output compared with that of `ar` on the same weights
    (`reference_of`)."""
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
                "timings": timings,
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
