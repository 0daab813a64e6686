"""The decode cost profile: seconds measured on this machine for one model, device, dtype and thread
count (`measure_profile`, `measure_in_decoding`, `measure_draft_heads`), kept per setting by the
machine profile (`MachineProfile.cost_profile`, on disk through `store`). A profile timed while the
machine was busy would mislead every later run that reads it, so a thorough profile's timings are
taken in interleaved rounds until two takes agree. A first run measures a quick one instead (a few
dozen steps' worth of timings: fewer row counts, one take, two cycles in decoding), so that a new
model's first answer does not wait for the thorough one, and a run allowed fewer new tokens than
`QUICK_PROFILE_STEPS` measures none (measuring would take longer than the run) until such runs
together were allowed that many (then one does: without a profile, `del-fast` prices drafts in
layers and takes no context drafts). Long-lived processes (the server, benchmarks) ask for a
thorough profile and replace a quick one. The cost model's `CostCheck` corrects a profile whose
predictions a run keeps contradicting.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from delspec.machine.timing import measurement_key, settled_seconds, timed
from delspec.model.transformer import Transformer

Ints = Sequence[int] | np.ndarray  # exit layers, draft lengths or vocabulary levels

PROFILE_VERSION = 18
# Rounds of a pass over the layers alone and with each draft head (`measure_draft_heads`)
DRAFT_HEAD_ROUNDS = 16
# Plain steps after a verification in which its cost may still show (`measure_in_decoding`): a
# long verification slows the few steps after it, the first most.
LINGER_STEPS = 4
# Timed cycles of `measure_in_decoding`: at most, at least, and how many seconds decide between
# (at the untimed first cycle's pace): a larger model's cycle takes longer, so it runs fewer
# cycles within the budget, never fewer than the least.
IN_DECODING_CYCLES = 8
IN_DECODING_MIN_CYCLES = 3
IN_DECODING_BUDGET_S = 24.0
# A quick profile: rounds of its one take of the primitives, and of its draft heads
QUICK_ROUNDS = 2
QUICK_CYCLES = 2  # cycles in decoding of a quick profile, the fastest of them taken
QUICK_DRAFT_HEAD_ROUNDS = 3  # odd: their median is one of them, not an outlier's mean
# About as many plain steps as a quick profile's timings take: a run allowed fewer new tokens
# would spend longer measuring than decoding, so it runs on the layer cost and leaves the
# profile to a longer run, or to the run at which such short runs' budgets add up to this.
QUICK_PROFILE_STEPS = 100


class ExitHeadLike(Protocol):
    """What a profile times of an exit head (`delspec.drafting.exit_head.ExitHead`, which
    drafting builds above this layer): its model, whether it drafts on int8 weights, and one
    draft row through each of its vocabulary levels."""

    model: Transformer
    int8: bool
    vocabs: list[Tensor | None]

    @property
    def vocab_sizes(self) -> list[int]: ...

    def __call__(self, h: Tensor, exit_layer: int, level: int = 0) -> Tensor: ...


@dataclass
class CostProfile:
    """Seconds measured for this model on one device/dtype/thread setting.

    `layer[k - 1]`: k new tokens through one layer after a context of `context` positions;
    `head[k - 1]`: k rows through the full LM head; `draft_layer`: one token through one layer
    as drafts run it (on int8 weights when `int8`); `layer_slope[k - 1]` and
    `draft_layer_slope`: what each position more of context adds to those (attention reads
    every earlier position); `draft_head[v]`: one row through the draft head's vocabulary level
    v (`ExitHead.vocabs`), for the head the profile was loaded for; `lingering[k - 1]`: what a
    round verifying k rows through every layer adds to the plain steps after it (none for one
    row; empty: nothing measured, as in a profile made by hand). `settled`: whether
    the timings can be trusted (two takes agreed); an unsettled profile is measured again after
    an hour rather than a week. `quick`: measured by `measure_profile(quick=True)`, replaced
    when a thorough profile is asked for. `path`: the file it was read from or written to (not
    stored).
    """

    layer: list[float]
    head: list[float]
    draft_layer: float
    draft_head: list[float]
    int8: bool
    key: str
    measured_at: float
    context: int = 0
    layer_slope: list[float] = field(default_factory=list)
    draft_layer_slope: float = 0.0
    lingering: list[float] = field(default_factory=list)
    version: int = PROFILE_VERSION
    settled: bool = field(default=True, compare=False)
    quick: bool = field(default=False, compare=False)
    path: str = field(default="", compare=False)

    def scale(self, factor: float, drafts_only: bool = False) -> None:
        """Multiply the timings by `factor` in place: all of them, or (`drafts_only`) only those
        of drafting from a layer (its passes and draft heads)."""
        if not drafts_only:
            for name in ("layer", "head", "layer_slope", "lingering"):
                setattr(self, name, [t * factor for t in getattr(self, name)])
        self.draft_layer *= factor
        self.draft_layer_slope *= factor
        self.draft_head = [t * factor for t in self.draft_head]

    def scale_rows(self, rows: int, factor: float) -> None:
        """Multiply the timings of `rows` positions through the layers and through the head by
        `factor` in place (what one round verifying that many rows costs)."""
        for values in (self.layer, self.head, self.layer_slope):
            if rows <= len(values):
                values[rows - 1] *= factor


def profile_key(exit_head: ExitHeadLike, threads: int) -> str:
    """Identifies the setting a profile's model timings were measured for (`measurement_key`
    with `threads` threads), and whether drafts run on int8 weights (not the draft head's
    vocabulary: its timings are kept per vocabulary within the profile)."""
    return measurement_key(exit_head.model, threads, "int8" if exit_head.int8 else "exact")


def measure_profile(
    exit_head: ExitHeadLike,
    exit_layer: int,
    max_tokens: int,
    context: int = 128,
    far: int = 512,
    repeats: int = 3,
    quick: bool = False,
) -> CostProfile:
    """Time the primitives a round is made of, for 1..max_tokens new tokens (at the row
    counts of `row_counts`, in between by interpolation), after `context` positions and (for
    the layers' slopes: at 1, half and all of max_tokens rows) after `far`; drafts through
    `exit_head` as exit layer `exit_layer`. Each primitive's fastest of `repeats` rounds in
    which they all take turns, taken again until two takes agree (`settled_seconds`); k rows
    through every layer and the head (a verification), and what they add to the steps after
    them, as decoding meets them, in proportion to a plain step (`measure_in_decoding`).
    `quick`: at `quick_counts` only, one take of `QUICK_ROUNDS` rounds without an untimed one,
    `QUICK_CYCLES` cycles in decoding
    (one step after each round) and `QUICK_DRAFT_HEAD_ROUNDS` rounds of draft heads (noisier:
    `CostCheck` corrects what decoding contradicts)."""
    model = exit_head.model
    cfg, int8 = model.config, exit_head.int8
    far = max(min(cfg.max_position - max_tokens - 1, far), 0)
    context = min(context, far)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (max_tokens,), generator=gen).to(model.device)
    linger = 1 if quick else LINGER_STEPS
    counts = quick_counts(max_tokens) if quick else row_counts(max_tokens)
    cycles = QUICK_CYCLES if quick else IN_DECODING_CYCLES
    # parts: the layer and head timings, each cycle in decoding (and its untimed one), the
    # draft heads; on a terminal only
    bar = tqdm(
        total=cycles + 3,
        desc="measuring decode costs",
        unit="part",
        file=sys.stderr,
        leave=False,
        disable=None,
    )
    # the positions before `context` and `far` are left as the fresh cache has them (zeros):
    # attention reads them at the same cost whatever they hold, so no prompt is prefilled
    with model.scratch_cache(far + max_tokens + 1), torch.inference_mode():
        states = model.embed(ids)
        runs, timed, sampled = _primitive_runs(model, states, context, far, int8, counts)
        if quick:
            # no untimed calls: the fastest of two timed ones (the first may run cold)
            seconds, settled = settled_seconds(runs, QUICK_ROUNDS, model.device, 1, warm=False)
        else:
            seconds, settled = settled_seconds(runs, repeats, model.device)
        bar.update()
        own, lingering = measure_in_decoding(
            model,
            states,
            context,
            cycles,
            counts=counts,
            warm=not quick,
            linger=linger,
            bar=bar,
            pick=min if quick else statistics.median,
        )
    rounds = QUICK_DRAFT_HEAD_ROUNDS if quick else DRAFT_HEAD_ROUNDS
    draft_head, heads_settled = measure_draft_heads(exit_head, exit_layer, rounds)
    bar.update()
    bar.close()
    profile = _profile(exit_head, seconds, own, lingering, timed, sampled, context, far)
    profile.draft_head = draft_head
    profile.settled = settled and heads_settled
    profile.quick = quick
    return profile


def _primitive_runs(
    model: Transformer, states: Tensor, context: int, far: int, int8: bool, counts: list[int]
) -> tuple[dict[object, Callable[[], object]], list[int], list[int]]:
    """The runs `measure_profile` times, keyed ("layer", at, k) (k rows through every layer at
    position `at`), ("drafted", at) (one row as drafts run it), ("head", k) and "step" (a plain
    step), from the most rows to the fewest; and the row counts timed after `context` (`counts`
    and those sampled) and, sampled for the slopes, after `far`."""
    layers, max_tokens, one = model.num_layers, len(states), states[:1]
    runs: dict[object, Callable[[], object]] = {}
    rows_of: dict[object, int] = {}  # each run's rows
    sampled = sorted({1, (max_tokens + 1) // 2, max_tokens})  # far on, slopes in between
    timed = sorted({*counts, *sampled})
    for at, counts in ((context, timed), (far, sampled)):
        for k in counts:
            h = states[:k]
            runs["layer", at, k] = lambda h=h, at=at: model.run_layers(h, at, 0, layers)
            rows_of["layer", at, k] = k
        runs["drafted", at] = lambda at=at: model.run_layers(one, at, 0, layers, None, int8)
        rows_of["drafted", at] = 1
    for k in timed:
        h = states[:k]
        runs["head", k] = lambda h=h: model.head(h)
        rows_of["head", k] = k
    # a plain step as decoding runs it: the head's weights read just after the layers' (each
    # timed alone finds the caches as its previous run left them, which a decode loop does not)
    runs["step"] = lambda: model.head(model.run_layers(one, context, 0, layers))
    rows_of["step"] = 1
    # taken from the most rows to the fewest: the few steps after a long verification run
    # slower, so a one-row run right after a many-row one would read dearer than in a decode
    # loop, and a layer draft's every pass with it
    ordered = dict(sorted(runs.items(), key=lambda run: -rows_of[run[0]]))
    return ordered, timed, sampled


def _profile(
    exit_head: ExitHeadLike,
    seconds: dict,
    own: list[float],
    lingering: list[float],
    timed: list[int],
    sampled: list[int],
    context: int,
    far: int,
) -> CostProfile:
    """The profile of `_primitive_runs`' `seconds` and `measure_in_decoding`'s `own` and
    `lingering` (its draft heads still to fill in)."""
    layers = exit_head.model.num_layers
    every = range(1, max(timed) + 1)  # 1..max_tokens
    span = max(far - context, 1)
    # the layers without the head, and the head timed alone, at every row count
    alone = np.interp(every, timed, [seconds["layer", context, k] for k in timed]).tolist()
    head_alone = np.interp(every, timed, [seconds["head", k] for k in timed]).tolist()
    # k rows with the head as decoding meets them (in proportion to a plain step), no less
    # than the layers alone nor than fewer rows: a round that verifies more never reads as
    # cheaper
    step = seconds["step"]
    rows = np.maximum.accumulate([max(step * own[k - 1], alone[k - 1]) for k in every])
    # the head's share of k rows: what they took beyond the layers alone (the head as a step
    # meets it, right after the layers' weights; timed alone, after another run, the head of
    # fewer rows can read dearer than of more), at least half of the head timed alone
    head = [max(rows[k - 1] - alone[k - 1], 0.5 * head_alone[k - 1]) for k in every]
    near = [(rows[k - 1] - head[k - 1]) / layers for k in every]  # a layer's share of k rows
    # per layer, what `far` positions add to the same rows after `context` (layers alone)
    measured = [(seconds["layer", far, k] - alone[k - 1]) / layers for k in sampled]
    deep = [n + float(np.interp(k, sampled, measured)) for k, n in zip(every, near, strict=True)]
    drafted = seconds["drafted", context] / layers
    return CostProfile(
        layer=near,
        head=head,
        draft_layer=drafted,
        draft_head=[],
        int8=exit_head.int8,
        key="",  # the keeper's (`MachineProfile.cost_profile`)
        measured_at=time.time(),
        context=context,
        layer_slope=[max(d - n, 0.0) / span for n, d in zip(near, deep, strict=True)],
        draft_layer_slope=max(seconds["drafted", far] / layers - drafted, 0.0) / span,
        lingering=[step * g for g in lingering],
    )


def row_counts(most: int) -> list[int]:
    """The row counts at which verifications are timed, up to `most`: every count up to 6,
    then about every 30% more (a verification's cost grows smoothly with its rows there)."""
    counts = {*range(1, min(most, 6) + 1), *np.geomspace(6, most, 6).round().astype(int).tolist()}
    return sorted(k for k in counts if k <= most)


def quick_counts(most: int) -> list[int]:
    """The row counts a quick profile times, up to `most`: 1, 2, 4, half and all of `most`."""
    return sorted(k for k in {1, 2, 4, (most + 1) // 2, most} if 1 <= k <= most)


def measure_in_decoding(
    model: Transformer,
    states: Tensor,
    context: int,
    cycles: int = IN_DECODING_CYCLES,
    budget_s: float = IN_DECODING_BUDGET_S,
    bar: tqdm | None = None,
    counts: list[int] | None = None,
    warm: bool = True,
    linger: int = LINGER_STEPS,
    pick: Callable[[list[float]], float] = statistics.median,
) -> tuple[list[float], list[float]]:
    """How rounds verifying k = 1..len(states) rows through every layer and the head cost as
    decoding meets them, in plain steps: their own time, and what they add to the `linger`
    plain steps after them (the first bears the most). A block is a plain step, the round, then
    those steps; each round's block follows a block whose round is a plain step, and what the round
    adds is the difference of the two blocks' last steps (a long verification slows the steps
    after it; timed in a loop of their own shapes, a few rows read cheaper than decoding meets
    them), fitted as one slope per row beyond the first. Medians over cycles of shuffled turns,
    after an untimed one, at the row counts of `row_counts` (in between by interpolation): up
    to `cycles` timed cycles, as many as `budget_s` holds at the untimed cycle's pace but no
    fewer than `IN_DECODING_MIN_CYCLES` (a large model's first run waits for fewer). `states`:
    the rows' inputs, run at positions `context`.. of the model's cache. `bar` advances a cycle
    at a time. `counts`: the row counts to time (default `row_counts`; 1 and the most among
    them); without `warm`, no untimed cycle (the caller ran the same shapes just before) and
    exactly `cycles` cycles; `pick`: what a count's samples come to (their median; a quick
    profile's two cycles take the fastest: one slow moment would price every larger count,
    which may cost no less, as dear)."""
    layers, most = model.num_layers, len(states)
    counts = sorted({1, most, *(counts or row_counts(most))})

    def run(rows: int) -> float:
        def step() -> Tensor:
            return model.head(model.run_layers(states[:rows], context, 0, layers))

        return timed(step, model.device)

    def block(rows: int) -> tuple[float, float]:
        """A plain step, `rows` rows, `linger` plain steps: the round's and the steps'
        seconds."""
        run(1)
        round_s = run(rows)
        return round_s, sum(run(1) for _ in range(linger))

    own: dict[int, list[float]] = {k: [] for k in counts}
    added: dict[int, list[float]] = {k: [] for k in counts}
    order = list(counts)
    shuffle = random.Random(0).shuffle
    cycle, start = (0, time.perf_counter()) if warm else (1, 0.0)
    while cycle <= cycles:
        shuffle(order)
        for k in order:
            _, reference = block(1)
            seconds, steps = block(k)
            if cycle:
                own[k].append(seconds)
                added[k].append(steps - reference)
        if not cycle:  # the untimed cycle: how many timed ones the budget holds
            pace = time.perf_counter() - start
            cycles = min(cycles, max(IN_DECODING_MIN_CYCLES, int(budget_s / pace)))
            if bar is not None:
                bar.total = bar.n + cycles + 2  # these, and the draft heads after them
        if bar is not None:
            bar.update()
        cycle += 1
    plain = pick(own[1])
    own_k = [pick(own[k]) / plain for k in counts]
    every = np.arange(1, most + 1)
    rows = np.maximum.accumulate(np.interp(every, counts, own_k))
    added_k = [pick(added[k]) / plain for k in counts]
    return rows.tolist(), lingering_line(counts, added_k, most)


def lingering_line(counts: list[int], added: list[float], most: int) -> list[float]:
    """What rounds of 1..`most` rows leave to the plain steps after them (in plain steps), from
    the medians `added` measured at row `counts`: one slope per row beyond the first through
    all of them, none below 0. What a round leaves grows with its rows, and each median is
    noisy (on a busy machine, in no order across the counts), where the largest median so far
    from each count on would price every round of a few rows and more at that noise."""
    extra = np.asarray(counts, dtype=np.float64) - 1
    total = float(extra @ extra)
    slope = max(float(extra @ np.asarray(added)) / total, 0.0) if total else 0.0
    return (slope * np.arange(most)).tolist()


def measure_draft_heads(
    exit_head: ExitHeadLike, exit_layer: int, rounds: int = DRAFT_HEAD_ROUNDS
) -> tuple[list[float], bool]:
    """Seconds of one draft row through each of `exit_head`'s vocabulary levels as drafts run
    it, right after a pass over the layers (a head timed alone keeps its rows in the caches and
    looks several times cheaper than it is between layers): `rounds` rounds of a pass alone and
    a pass with each level's head, in turns, after an untimed one, priced by `head_costs`. Also
    whether the rounds' two halves agree."""
    model = exit_head.model
    layers, int8 = model.num_layers, exit_head.int8
    with model.scratch_cache(1), torch.inference_mode():
        one = model.embed(torch.zeros(1, dtype=torch.long, device=model.device))

        def run_layers() -> Tensor:
            return model.run_layers(one, 0, 0, layers, None, int8)

        levels = range(len(exit_head.vocabs))
        runs = [run_layers, *(lambda v=v: exit_head(run_layers(), exit_layer, v) for v in levels)]
        samples = []
        for turn in range(rounds + 1):  # the first untimed
            times = [timed(run, model.device) for run in runs]
            if turn:
                samples.append(times)
    return head_costs(samples)


def head_costs(samples: list[list[float]], tolerance: float = 1.25) -> tuple[list[float], bool]:
    """Each vocabulary level's seconds from rounds of timings (`samples[i]`: a pass alone, then
    a pass with each level's head): the median over the rounds of its pass less the same
    round's pass alone (a busy moment of the machine falls on both: the fastest of each, taken
    apart, can price a pruned draft head at very different shares of the full head from one run
    to the next on a busy machine, and a run that looks too dear never drafts to correct it),
    never below a smaller level's. Also whether the two halves of the rounds give medians within
    `tolerance` of each other (False: a busy machine; the profile is taken again sooner)."""
    added = np.array([[t - row[0] for t in row[1:]] for row in samples])

    def medians(part: np.ndarray) -> np.ndarray:
        return np.maximum.accumulate(np.maximum(np.median(part, 0), 0.0))

    half = len(samples) // 2
    first, second = medians(added[:half]), medians(added[half:])
    agree = all(max(a, b) <= tolerance * min(a, b) for a, b in zip(first, second, strict=True))
    return medians(added).tolist(), bool(agree)
