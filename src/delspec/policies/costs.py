"""Cost models for choosing the exit layer and draft length: what one round costs.

`LayerCost` is the paper's (layer loads). `MeasuredCost` uses seconds measured on the actual
device, dtype and thread count (`measure_profile`), cached per model and setting. A profile timed
while the machine was busy would mislead every later run that reads it (issue 29: 250x too slow,
for a week), so timings are taken in interleaved rounds until two takes agree, and `CostCheck`
compares a run's rounds with the profile's predictions and corrects the profile (and marks its
file for measuring again) when they disagree for a sustained stretch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from delspec.cache import write_atomically
from delspec.drafting.exit_head import ExitHead
from delspec.kernels.build import build_key, cpu_name
from delspec.machine.timing import MEASURED_MAX_AGE_S, settled_seconds, synchronize
from delspec.model.transformer import Transformer
from delspec.policies.protocol import Round

Array = np.ndarray
Ints = Sequence[int] | np.ndarray  # exit layers, draft lengths or vocabulary levels

LOG = logging.getLogger(__name__)
UNSETTLED_MAX_AGE_S = 3600  # a profile whose takes never agreed is measured again after this
PROFILE_VERSION = 17
# Rounds of a pass over the layers alone and with each draft head (`measure_draft_heads`)
DRAFT_HEAD_ROUNDS = 16
# Plain steps after a verification in which its cost may still show (`measure_in_decoding`), and
# the share of what a round leaves that shows in the next one (`CostCheck`): on an Intel Xeon, a
# verification of 19 rows slowed the four steps after it by about a step in all, most of it in
# the first.
LINGER_STEPS = 4
LINGER_SHARE = 0.5
# Timed cycles of `measure_in_decoding`: at most, at least, and how many seconds decide between
# (at the untimed first cycle's pace). SmolLM2's cycle takes ~0.5-1 s on a 2-core Xeon, a
# 1 GB Q4_K_M file's ~7 s (eight cycles: ~1 minute of a first run), an 8B's about 5x that.
IN_DECODING_CYCLES = 8
IN_DECODING_MIN_CYCLES = 3
IN_DECODING_BUDGET_S = 24.0
# How many standard errors a gap between k rows' and plain steps' mean log ratio must exceed
# before the profile's k rows are corrected (`CostCheck.observe_rows`)
NOISE_ERRORS = 3.0


class LayerCost:
    """The paper's cost: layer loads per round, d*l (drafting) + L (verification)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def grid(self, exit_layers: Ints, draft_lengths: Ints, levels: Ints | None = None) -> Array:
        """`[exit layers, draft lengths]` cost of one round (d = 0 is a plain step); layer loads
        do not depend on the draft vocabulary `levels`."""
        d = np.asarray(draft_lengths, dtype=np.float64)[None, :]
        return d * np.asarray(exit_layers, dtype=np.float64)[:, None] + self.num_layers


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
    an hour rather than a week. `path`: the file it was read from or written to (not stored).
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


class MeasuredCost:
    """Round cost in seconds from a `CostProfile`, plus the policy's own work per round.

    That work is kept apart for rounds that draft from an exit layer (`layer_overhead`) and
    the others (`overhead`): counting a layer's drafts and choosing the plan again cost several
    times a plain step's bookkeeping (0.6-0.9 ms against 0.05-0.15 ms on SmolLM2), a good share
    of what a one-token layer draft saves, and one figure for both made layer drafts look
    cheaper and plain steps dearer than they are.

    Drafting d tokens with exit layer l and vocabulary level v costs
    d * (l * draft_layer + draft_head[v]). Verification
    runs the last draft token through layers [0, l) and d + 1 positions through [l, L) and the
    full head; after int8 drafts, d + 1 positions through every layer and the full head. d = 0
    is a plain step: L * layer(1) + head(1).

    A round that first drafts c context tokens (free to make) verifies c + d + 1 positions; with
    layer drafts after them, drafting runs the input and the c tokens through [0, l) in one pass
    and d - 1 more tokens one at a time. With d = 0 it is every layer over c + 1 positions.
    A round that takes a context tokens after its d > 0 layer drafts runs them through [0, l)
    with the last draft token, and verifies c + d + a + 1 positions.

    A round also costs what its verification adds to the plain steps after it (the profile's
    `lingering`, for the rows it runs through every layer; after layer drafts from exit l, the
    share of the layers [l, L) it runs over them): `lingering_of` tells that part apart, which
    `CostCheck` looks for in the rounds after.

    Layer timings are those at the sequence position set by `at` (the profile's own context
    until then): a layer reads every earlier position, so rounds cost more as a reply grows.
    """

    def __init__(self, profile: CostProfile, num_layers: int) -> None:
        self.profile = profile
        self.num_layers = num_layers
        # seconds of policy work per round without and with exit-layer drafts (the policy's)
        self.overhead = self.layer_overhead = 0.0
        self.check = CostCheck(self)  # compares the rounds that ran with this cost's predictions
        self.position = profile.context
        self._rows_monotone()
        self._plain = self._plain_parts()
        # per grid asked for: its seconds at the profile's context and per position further on,
        # and which of its columns draft from a layer
        self._grids: dict[tuple, tuple[Array, Array, Array]] = {}
        self._cells: dict[tuple, tuple[float, float]] = {}  # the same for `round_seconds`
        self._after: dict[tuple, tuple[list[float], list[float]]] = {}  # for `after_seconds`
        self._lingered: dict[tuple, float] = {}  # for `lingering_of`

    def at(self, position: int) -> None:
        """Predict rounds that start after `position` positions of the sequence."""
        self.position = position

    def rescaled(self) -> None:
        """The profile's timings changed in place (`CostProfile.scale`): predict from them."""
        self._rows_monotone()
        self._plain = self._plain_parts()
        self._grids.clear()
        self._cells.clear()
        self._after.clear()
        self._lingered.clear()

    def _plain_parts(self) -> list[tuple[float, float]]:
        """Per row count k (from 1): the seconds of k rows through every layer and the full head
        at the profile's context with what they leave to the steps after, and what each
        position further adds (`plain_seconds`)."""
        p, layers = self.profile, self.num_layers
        slopes = p.layer_slope or [0.0] * len(p.layer)
        lingering = p.lingering or [0.0] * len(p.layer)
        return [
            (layers * t + h + g, layers * s)
            for t, h, s, g in zip(p.layer, p.head, slopes, lingering, strict=True)
        ]

    def grid(
        self,
        exit_layers: Ints,
        draft_lengths: Ints,
        levels: Ints | None = None,
        context: int = 0,
    ) -> Array:
        """`[rows, draft lengths]` seconds of one round drafting `context` context tokens, then
        d (the draft length) from layer `exit_layers[i]` with vocabulary level `levels[i]`
        (default 0) in row i. A round's seconds grow linearly with its position, so each grid
        is worked out once (at the profile's context, and per position beyond) and then only
        moved to the position (a policy asks for the same grid every round: given as tuples,
        the arguments are its key as they are)."""
        exits = _as_key(exit_layers)
        chosen = (0,) * len(exits) if levels is None else _as_key(levels)
        key = (exits, _as_key(draft_lengths), chosen, context)
        parts = self._grids.get(key)
        if parts is None:
            drafts = np.asarray(key[1])[None, :] > 0  # columns of rounds with layer drafts
            parts = self._grids[key] = (*self._grid_parts(*key), drafts)
        base, per_position, drafts = parts
        overhead = np.where(drafts, self.layer_overhead, self.overhead)
        return self._here(base, per_position, overhead)

    def _grid_parts(
        self, exits: Ints, lengths: Ints, levels: Ints, context: int, after: int | Array = 0
    ) -> tuple[Array, Array]:
        """A grid's seconds at the profile's context, and what each position further adds
        (`after`: context tokens after the layer drafts, one count or one per length)."""
        p = self.profile
        shape = (tuple(exits), tuple(lengths), tuple(levels), context, after)
        base = self._seconds(p.layer, p.draft_layer, p.head, p.draft_head, *shape)
        base = base + self._lingering(exits, lengths, context, after)
        slopes = p.layer_slope or [0.0] * len(p.layer)
        nothing = [0.0] * len(p.head), [0.0] * len(p.draft_head)
        return base, self._seconds(slopes, p.draft_layer_slope, nothing[0], nothing[1], *shape)

    def round_seconds(
        self, exit_layer: int, drafted: int, level: int, context: int, after: int = 0
    ) -> float:
        """`grid`'s one cell, for a round that ran (kept per cell as a number: a policy asks
        for each round's, where a grid's work per call would cost a good share of a step),
        with `after` context tokens after the `drafted` layer drafts."""
        key = (exit_layer, drafted, level, context, after)
        parts = self._cells.get(key)
        if parts is None:
            base, per_position = self._grid_parts([exit_layer], [drafted], [level], *key[3:])
            parts = self._cells[key] = (float(base[0, 0]), float(per_position[0, 0]))
        return self._here(*parts, self.overhead_of(drafted > 0))

    def after_seconds(self, exit_layer: int, drafted: int, level: int, most: int) -> list[float]:
        """`round_seconds` of a round of `drafted` layer drafts (no context drafts first)
        followed by 0, 1, ..., `most` context tokens, worked out in one pass per round shape
        (a policy weighs every prefix of a proposal after a round's drafts)."""
        key = (exit_layer, drafted, level)
        parts = self._after.get(key)
        if parts is None:
            count = len(self.profile.layer)  # rows beyond the profile's cost what its last does
            lengths, after = [drafted] * count, np.arange(count)
            base, per_position = self._grid_parts([exit_layer], lengths, [level], 0, after)
            parts = self._after[key] = (base[0].tolist(), per_position[0].tolist())
        overhead = self.overhead_of(drafted > 0)
        base, per_position = parts
        last = len(base) - 1
        return [
            self._here(base[min(k, last)], per_position[min(k, last)], overhead)
            for k in range(most + 1)
        ]

    def lingering_of(
        self, exit_layer: int, drafted: int, level: int, context: int, after: int = 0
    ) -> float:
        """The part of `round_seconds` that the round adds to the plain steps after it."""
        key = (exit_layer, drafted, context, after)
        seconds = self._lingered.get(key)
        if seconds is None:
            lingering = self._lingering((exit_layer,), (drafted,), context, after)
            seconds = self._lingered[key] = float(lingering[0, 0])
        return seconds

    def _lingering(
        self, exit_layers: Ints, draft_lengths: Ints, context: int, after: int | Array
    ) -> Array:
        """`[exit layers, draft lengths]`: what each round leaves to the steps after it, for
        the rows it runs through every layer (after layer drafts from exit e, the share of the
        layers [e, L) that ran over every row; the int8 verification runs them all)."""
        lengths = np.asarray(draft_lengths)
        e = np.asarray(exit_layers, dtype=np.float64)[:, None]
        lingering = np.asarray(self.profile.lingering or [0.0] * len(self.profile.layer))
        rows = lengths + context + np.where(lengths > 0, after, 0) + 1
        left = lingering[np.minimum(rows, len(lingering)) - 1][None, :]
        if self.profile.int8:
            return np.broadcast_to(left, (len(e), len(lengths))).copy()
        deep = (self.num_layers - e) / self.num_layers
        return np.where(lengths[None, :] > 0, deep * left, left)

    def overhead_of(self, layer_drafts: bool) -> float:
        """The policy's seconds per round with or without exit-layer drafts."""
        return self.layer_overhead if layer_drafts else self.overhead

    def _here(self, base: Any, per_position: Any, overhead: Any) -> Any:
        """Seconds (a grid's or one cell's) moved to the current position, with `overhead`."""
        return base + max(self.position - self.profile.context, 0) * per_position + overhead

    def _seconds(
        self,
        layer_s: list[float],
        drafted: float,
        head_s: list[float],
        draft_head_s: list[float],
        exit_layers: tuple[int, ...],
        draft_lengths: tuple[int, ...],
        levels: tuple[int, ...],
        context: int,
        after: int | Array,
    ) -> Array:
        """`grid` without the overhead and what rounds leave to the steps after, from the
        given timings (which it is linear in)."""
        layer, head = np.asarray(layer_s), np.asarray(head_s)
        lengths = np.asarray(draft_lengths)
        after_drafts = np.where(lengths > 0, after, 0)  # context tokens after layer drafts
        rows = lengths + context + after_drafts + 1
        k = np.minimum(rows, len(layer_s)) - 1  # index of rows verified
        e = np.asarray(exit_layers, dtype=np.float64)[:, None]
        d = lengths[None, :].astype(np.float64)
        head_d = np.asarray(draft_head_s)[list(levels)][:, None]
        if context:  # one pass over the input and the context tokens, then d - 1 tokens
            first = layer[min(context, len(layer_s) - 1)]
            draft = np.where(d > 0, e * first + (d - 1) * e * drafted + d * head_d, 0.0)
        else:
            draft = d * (e * drafted + head_d)
        every_layer = self.num_layers * layer[k][None, :] + head[k][None, :]
        if self.profile.int8:  # every layer again over every position
            verify = every_layer
        else:
            last = layer[np.minimum(after_drafts, len(layer_s) - 1)][None, :]  # [0, e) again
            verify = e * last + (self.num_layers - e) * layer[k][None, :] + head[k][None, :]
            verify = np.where(d > 0, verify, every_layer)  # no layer draft: every layer
        return draft + verify

    def correct_rows(self, rows: int, factor: float) -> None:
        """Rounds verifying `rows` positions take `factor` times what the profile says: scale
        their timings, bring fewer rows (but one) that would now cost more down to them, and
        predict from that (`rescaled`, which keeps more rows no cheaper than fewer). Lowered
        alone, a count was raised back to its uncorrected neighbour's cost: on an Intel Xeon
        whose host was busy, rounds of 7 rows were corrected by x0.79-0.85 five times in one
        process, and their cost stayed where it was."""
        self.profile.scale_rows(rows, factor)
        corrected = self._total(rows)
        for fewer in range(2, min(rows, len(self.profile.layer) + 1)):
            if self._total(fewer) > corrected:
                self.profile.scale_rows(fewer, corrected / self._total(fewer))
        self.rescaled()

    def _total(self, rows: int) -> float:
        """The profile's seconds of `rows` positions through every layer and the full head."""
        return self.num_layers * self.profile.layer[rows - 1] + self.profile.head[rows - 1]

    def _rows_monotone(self) -> None:
        """Keep verifying more rows no cheaper than fewer (through every layer and the head):
        a correction of some row counts alone (`correct_rows`) could leave 2 rows cheaper than
        a plain step, and every context draft would look free."""
        for k in range(2, len(self.profile.layer) + 1):
            if self._total(k) < self._total(k - 1):
                self.profile.scale_rows(k, self._total(k - 1) / self._total(k))

    def plain_seconds(self, rows: int) -> float:
        """Seconds of a round running `rows` positions through every layer and the full head:
        a plain step (1), or a context draft of `rows - 1` tokens and its verification."""
        base, per_position = self._plain[min(rows, len(self._plain)) - 1]
        return self._here(base, per_position, self.overhead)


def _as_key(values: Ints) -> tuple[int, ...]:
    """`values` as a tuple of ints (a tuple is taken as it is)."""
    return values if isinstance(values, tuple) else tuple(np.asarray(values).tolist())


def profile_key(exit_head: ExitHead) -> str:
    """Identifies the setting a profile's model timings were measured for: model shape, device
    (and the CPU), dtype, weight format, threads, the compiled kernels' build, and whether drafts
    run on int8 weights (not the draft head's vocabulary: its timings are kept per vocabulary
    within the profile)."""
    model = exit_head.model
    parts = [
        repr(model.config),
        str(model.device),
        cpu_name(),
        str(model.dtype),
        model.weights,
        str(torch.get_num_threads()),
        torch.__version__,
        build_key(),
        "int8" if exit_head.int8 else "exact",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measure_profile(
    exit_head: ExitHead,
    exit_layer: int,
    max_tokens: int,
    context: int = 128,
    far: int = 512,
    repeats: int = 3,
) -> CostProfile:
    """Time the primitives a round is made of, for 1..max_tokens new tokens (at the row
    counts of `row_counts`, in between by interpolation), after `context` positions and (for
    the layers' slopes: at 1, half and all of max_tokens rows) after `far`; drafts through
    `exit_head` as exit layer `exit_layer`. Each primitive's fastest of `repeats` rounds in
    which they all take turns, taken again until two takes agree (`settled_seconds`); k rows
    through every layer and the head (a verification), and what they add to the steps after
    them, as decoding meets them, in proportion to a plain step (`measure_in_decoding`)."""
    model = exit_head.model
    cfg, int8, layers = model.config, exit_head.int8, model.num_layers
    far = max(min(cfg.max_position - max_tokens - 1, far), 0)
    context = min(context, far)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (far + max_tokens,), generator=gen).to(model.device)
    # parts: the layer and head timings, each cycle in decoding (and its untimed one), the
    # draft heads; on a terminal only
    bar = tqdm(
        total=IN_DECODING_CYCLES + 3,
        desc="measuring decode costs",
        unit="part",
        file=sys.stderr,
        leave=False,
        disable=None,
    )
    with model.scratch_cache(far + max_tokens + 1), torch.inference_mode():
        if far:
            model.run_layers(model.embed(ids[:far]), 0, 0, layers)
        states = model.embed(ids[far:])
        one = states[:1]

        runs: dict[object, Callable[[], object]] = {}
        rows_of: dict[object, int] = {}  # each run's rows
        every = range(1, max_tokens + 1)
        sampled = sorted({1, (max_tokens + 1) // 2, max_tokens})  # far on, slopes in between
        timed = sorted({*row_counts(max_tokens), *sampled})
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
        # a plain step as decoding runs it: the head's weights read just after the layers'
        # (each timed alone found the caches as its previous run left them: one row through
        # the layers came out 30% slower than in a decode loop on SmolLM2, and a head alone up
        # to 2x faster)
        runs["step"] = lambda: model.head(model.run_layers(one, context, 0, layers))
        rows_of["step"] = 1
        # taken from the most rows to the fewest: the few steps after a long verification run
        # slower (on an Intel Xeon, the step after 19 rows up to 1.6x, recovering over about
        # four steps), and in the order they were built, the one-row runs came right after the
        # 19-row ones: one row read 25-35% dearer than in a decode loop, and a layer draft's
        # every pass with it
        ordered = dict(sorted(runs.items(), key=lambda run: -rows_of[run[0]]))
        seconds, settled = settled_seconds(ordered, repeats, model.device)
        bar.update()
        own, lingering = measure_in_decoding(model, states, context, bar=bar)
    draft_head, heads_settled = measure_draft_heads(exit_head, exit_layer)
    bar.update()
    bar.close()
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
    # meets it, right after the layers' weights; timed alone, after another run, one row's
    # head read 1.5x two rows' on an Intel Xeon), at least half of the head timed alone
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
        draft_head=draft_head,
        int8=int8,
        key=profile_key(exit_head),
        measured_at=time.time(),
        context=context,
        layer_slope=[max(d - n, 0.0) / span for n, d in zip(near, deep, strict=True)],
        draft_layer_slope=max(seconds["drafted", far] / layers - drafted, 0.0) / span,
        lingering=[step * g for g in lingering],
        settled=settled and heads_settled,
    )


def row_counts(most: int) -> list[int]:
    """The row counts at which verifications are timed, up to `most`: every count up to 6,
    then about every 30% more (a verification's cost grows smoothly with its rows there)."""
    counts = {*range(1, min(most, 6) + 1), *np.geomspace(6, most, 6).round().astype(int).tolist()}
    return sorted(k for k in counts if k <= most)


def measure_in_decoding(
    model: Transformer,
    states: Tensor,
    context: int,
    cycles: int = IN_DECODING_CYCLES,
    budget_s: float = IN_DECODING_BUDGET_S,
    bar: tqdm | None = None,
) -> tuple[list[float], list[float]]:
    """How rounds verifying k = 1..len(states) rows through every layer and the head cost as
    decoding meets them, in plain steps: their own time, and what they add to the
    `LINGER_STEPS` plain steps after them. A block is a plain step, the round, then those
    steps; each round's block follows a block whose round is a plain step, and what the round
    adds is the difference of the two blocks' last steps (on an Intel Xeon, 19 rows slowed
    them by about a step in all, 9 rows by half a step; timed in a loop of their own shapes,
    2 rows read 1.12 plain steps where decoding took 1.25-1.3), fitted as one slope per row
    beyond the first. Medians over cycles of
    shuffled turns, after an untimed one, at the row counts of `row_counts` (in between by
    interpolation): up to `cycles` timed cycles, as many as `budget_s` holds at the untimed
    cycle's pace but no fewer than `IN_DECODING_MIN_CYCLES` (a large model's first run waits
    for fewer). `states`: the rows' inputs, run at positions `context`.. of the model's cache.
    `bar` advances a cycle at a time."""
    layers, most = model.num_layers, len(states)
    counts = row_counts(most)

    def run(rows: int) -> float:
        start = time.perf_counter()
        model.head(model.run_layers(states[:rows], context, 0, layers))
        synchronize(model.device)
        return time.perf_counter() - start

    def block(rows: int) -> tuple[float, float]:
        """A plain step, `rows` rows, `LINGER_STEPS` plain steps: the round's and the steps'
        seconds."""
        run(1)
        round_s = run(rows)
        return round_s, sum(run(1) for _ in range(LINGER_STEPS))

    own: dict[int, list[float]] = {k: [] for k in counts}
    added: dict[int, list[float]] = {k: [] for k in counts}
    order = list(counts)
    shuffle = random.Random(0).shuffle
    cycle, start = 0, time.perf_counter()
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
    plain = statistics.median(own[1])
    own_k = [statistics.median(own[k]) / plain for k in counts]
    every = np.arange(1, most + 1)
    rows = np.maximum.accumulate(np.interp(every, counts, own_k))
    added_k = [statistics.median(added[k]) / plain for k in counts]
    return rows.tolist(), lingering_line(counts, added_k, most)


def lingering_line(counts: list[int], added: list[float], most: int) -> list[float]:
    """What rounds of 1..`most` rows leave to the plain steps after them (in plain steps), from
    the medians `added` measured at row `counts`: one slope per row beyond the first through
    all of them, none below 0. What a round leaves grows with its rows, and each median is
    noisy: on a busy Intel Xeon a plain step's block read 0.1-0.6 steps from its reference's,
    and the other counts 0-0.4 steps in no order, where the largest median so far from each
    count on (the estimate before) priced every round of 2 or 3 rows and more at that noise."""
    extra = np.asarray(counts, dtype=np.float64) - 1
    total = float(extra @ extra)
    slope = max(float(extra @ np.asarray(added)) / total, 0.0) if total else 0.0
    return (slope * np.arange(most)).tolist()


def measure_draft_heads(
    exit_head: ExitHead, exit_layer: int, rounds: int = DRAFT_HEAD_ROUNDS
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
        for timed in range(rounds + 1):
            times = []
            for run in runs:
                synchronize(model.device)
                start = time.perf_counter()
                run()
                synchronize(model.device)
                times.append(time.perf_counter() - start)
            if timed:
                samples.append(times)
    return head_costs(samples)


def head_costs(samples: list[list[float]], tolerance: float = 1.25) -> tuple[list[float], bool]:
    """Each vocabulary level's seconds from rounds of timings (`samples[i]`: a pass alone, then
    a pass with each level's head): the median over the rounds of its pass less the same
    round's pass alone (a busy moment of the machine falls on both: the fastest of each, taken
    apart, priced SmolLM2's 16k-token draft head at 0.43 of the full head on one run and 0.66 on
    the next on a busy Intel Xeon, and a run that looks too dear never drafts to correct it),
    never below a smaller level's. Also whether the two halves of the rounds give medians within
    `tolerance` of each other (False: a busy machine; the profile is taken again sooner)."""
    added = np.array([[t - row[0] for t in row[1:]] for row in samples])

    def medians(part: np.ndarray) -> np.ndarray:
        return np.maximum.accumulate(np.maximum(np.median(part, 0), 0.0))

    half = len(samples) // 2
    first, second = medians(added[:half]), medians(added[half:])
    agree = all(max(a, b) <= tolerance * min(a, b) for a, b in zip(first, second, strict=True))
    return medians(added).tolist(), bool(agree)


def cached_profile(
    exit_head: ExitHead, exit_layer: int, max_tokens: int, directory: Path
) -> CostProfile:
    """The profile for this model and setting from `directory`, measured again when missing,
    older than a week (an hour when not `CostProfile.settled`), measured for fewer tokens. Draft
    head timings are stored per vocabulary (`ExitHead.vocab_sizes`) in the same file; a new one
    is measured and added."""
    path = directory / f"profile-{profile_key(exit_head)}.json"
    vocab = ",".join(map(str, exit_head.vocab_sizes))
    stored = _read_profile(path, max_tokens)
    if stored is None:
        print(
            f"delspec: measuring decode costs on {exit_head.model.device} (once; cached in "
            f"{directory})",
            file=sys.stderr,
        )
        profile = measure_profile(exit_head, exit_layer, max_tokens)
        profile.path = str(path)
        _write_profile(path, profile, {vocab: profile.draft_head})
        return profile
    profile, draft_heads = stored
    profile.path = str(path)
    if vocab in draft_heads:
        profile.draft_head = draft_heads[vocab]
    else:
        profile.draft_head, settled = measure_draft_heads(exit_head, exit_layer)
        draft_heads[vocab] = profile.draft_head
        profile.settled = profile.settled and settled  # an unsettled profile stays so
        _write_profile(path, profile, draft_heads)
    return profile


def _parse_profile(path: Path) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """The profile stored at `path` (without draft head timings) and its draft heads' timings
    per vocabulary; None when missing or unreadable."""
    try:
        stored = json.loads(path.read_text())
        draft_heads = dict(stored.pop("draft_heads"))
        return CostProfile(**stored, draft_head=[]), draft_heads
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _read_profile(path: Path, max_tokens: int) -> tuple[CostProfile, dict[str, list[float]]] | None:
    """`_parse_profile`, or None when of another version, older than a week (an hour when not
    settled), or for fewer tokens."""
    stored = _parse_profile(path)
    if stored is None:
        return None
    profile, draft_heads = stored
    age = MEASURED_MAX_AGE_S if profile.settled else UNSETTLED_MAX_AGE_S
    fresh = time.time() - profile.measured_at < age
    if fresh and profile.version == PROFILE_VERSION and len(profile.layer) >= max_tokens:
        return profile, draft_heads
    return None


def _write_profile(path: Path, profile: CostProfile, draft_heads: dict[str, list[float]]) -> None:
    """Write `profile`'s model timings and `draft_heads` (per vocabulary) atomically."""
    stored = {k: v for k, v in asdict(profile).items() if k not in ("draft_head", "path")}
    text = json.dumps({**stored, "draft_heads": draft_heads})
    write_atomically(path, lambda scratch: scratch.write_text(text))


def store_correction(path: str | Path, factor: float) -> None:
    """Scale every timing of the profile stored at `path` by `factor` (every vocabulary's draft
    head too), keeping when it was measured, so that the next process starts from timings the
    rounds agreed with (a missing or unreadable file is left alone)."""
    stored = _parse_profile(Path(path))
    if stored is None:
        return
    profile, draft_heads = stored
    profile.scale(factor)
    scaled = {vocab: [t * factor for t in times] for vocab, times in draft_heads.items()}
    _write_profile(Path(path), profile, scaled)


def mark_stale(path: str | Path) -> None:
    """Mark the profile stored at `path` stale (unsettled, measured at time 0), so that the next
    run measures it again (a missing or unreadable file is left alone)."""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return
    text = json.dumps({**stored, "settled": False, "measured_at": 0.0})
    write_atomically(Path(path), lambda scratch: scratch.write_text(text))


class CostCheck:
    """Compares the seconds a `MeasuredCost` predicts for each round with the seconds the round
    took, and corrects the profile when they disagree for a sustained stretch, or when rounds
    verifying several rows disagree with it more than plain steps do.

    A round is predicted to take its own time and `LINGER_SHARE` of what the rounds before it
    left to the rounds after them (`MeasuredCost.lingering_of`, what a verification of many
    rows adds to the steps after it): the steps after a long verification are not slow
    steps, nor is the long one cheap for not showing all it costs in its own time.

    Rounds are of two kinds, plain steps and drafting rounds, each with its own window of the
    last `window` ratios actual / predicted (the policy's own overhead, which the measured
    rounds do not include, taken off the prediction). When three quarters of a full window lie
    beyond [`low`, `high`] on one side, the profile is scaled in place by their median: for
    plain steps, every timing (the machine is slower or faster than when the profile was
    timed); for drafting rounds, the timings of drafting from a layer, or all of them while no
    window of plain steps has confirmed (or corrected) theirs. Once one has, rounds of context
    drafts alone are left to the check of their rows below: with them in the window, and the
    rows' timings scaled with the drafts', rounds of drafts from SmolLM2's final layer that ran
    0.6-0.7x their prediction priced verifying 2-5 rows at a plain step's cost (Intel Xeon),
    and every context draft looked free. The window then starts afresh. A factor beyond
    `extreme` (or its inverse) also marks the profile's file stale, so that the next run
    measures it again; any other correction from plain steps is stored in the file
    (`store_correction`), so that the next process starts from it (an AMD EPYC's profile, timed
    in a loop, read a third too fast for the rounds of every process, each correcting it
    anew): once the next full window of plain steps agrees with the corrected profile, the
    square root of the corrections made since the last store (a stretch that one window saw
    and the next did not leaves nothing; the next process starts halfway, in log terms, and
    corrects the rest if it holds: stored whole, three processes in a row on an Intel Xeon
    stored x1.56, x0.62 and x1.51, each undoing the one before). One from drafting rounds is
    not stored: how far drafting rounds are off follows what the process drafted, and stored,
    it prices the next process's plain steps too (on SmolLM2, one process whose drafting rounds
    ran 1.44x the profile before any plain steps were compared stored x1.44 for every timing,
    and the processes after it chose differently from the same prompts). Each correction is
    logged (logger `delspec.policies.costs`, level INFO: not printed into a streamed answer).

    Rounds without layer drafts (plain steps, context drafts alone) are also kept by the rows
    they verify: a decayed mean (by `row_decay` per such round) of the log of actual /
    predicted, each ratio taken within [1/2, 2] (a round an interruption stretched counts no
    more than that), with its standard error. Once rounds of k > 1 rows and plain steps each
    have `row_evidence` (decayed) rounds and k rows' mean is beyond `row_tolerance` of the plain
    steps' and beyond `NOISE_ERRORS` standard errors of their difference, the timings of k rows
    are scaled by the quotient (`MeasuredCost.correct_rows`) and k's mean starts afresh.
    Relative to plain steps timed in the same stretch, the machine's drift cancels out: what is
    left is what the profile got wrong about several rows (a cheap 2-3 rows lets context
    drafts through that cannot pay; on an AMD EPYC a profile timed in a loop was right within
    3-8% at every row count, and this stays quiet). On a busy host single rounds scatter by
    ~15% (the standard deviation of their log ratios, Intel Xeon), and with the tolerance alone
    4 and 8 rows were corrected by x0.77-0.86 and then x1.15-1.25 in one process.
    """

    def __init__(
        self,
        cost: MeasuredCost,
        window: int = 8,
        low: float = 0.7,
        high: float = 1.4,
        extreme: float = 3.0,
        row_decay: float = 0.97,
        row_evidence: float = 6.0,
        row_tolerance: float = 1.15,
    ) -> None:
        self.cost = cost
        self.window, self.low, self.high, self.extreme = window, low, high, extreme
        self.row_decay, self.row_evidence = row_decay, row_evidence
        self.row_tolerance = row_tolerance
        self.ratios = {False: deque(maxlen=window), True: deque(maxlen=window)}
        self.corrections: list[float] = []  # factors applied, in order
        self.row_corrections: list[tuple[int, float]] = []  # (rows, factor) applied, in order
        self.plain_confirmed = False  # a full window of plain steps agreed, or corrected them
        self.unstored = 1.0  # plain steps' corrections since the last stored, not yet confirmed
        # rows -> decayed sums of the log ratios, of their squares, of the rounds' weights and
        # of the weights' squares
        self.row_logs: dict[int, list[float]] = {}
        self.carried = 0.0  # seconds the rounds so far left to the next ones (`lingering_of`)

    def observe_round(self, record: Round) -> float | None:
        """`observe` a round the engine ran, predicted by the cost's grid for its plan: context
        tokens, exit layer, tokens drafted from it, vocabulary level (a plain step: none): its
        own time, and `LINGER_SHARE` of what the rounds before it left (each round leaves
        `MeasuredCost.lingering_of`, shown that way over the rounds after it). A profile that
        was not measured (no `path`: given by hand) is left as it is."""
        if not self.cost.profile.path:
            return None
        d = record.layer_drafts
        shape = (
            record.exit_layer if d else 0,
            d,
            record.level if d else 0,
            record.from_context,
            record.context_after,
        )
        lingering = self.cost.lingering_of(*shape)
        # the round's own time, and the share of what the rounds before it left that shows here
        predicted = self.cost.round_seconds(*shape) - lingering + LINGER_SHARE * self.carried
        self.carried = (1 - LINGER_SHARE) * self.carried + lingering
        actual = record.draft_s + record.verify_s
        model_s = predicted - self.cost.overhead_of(d > 0)
        if not d and model_s > 0 and actual > 0:
            self.observe_rows(record.from_context + 1, model_s, actual)
        if record.drafted and not d and self.plain_confirmed:
            return None  # context drafts alone: their rows are checked above
        return self.observe(model_s, actual, bool(record.drafted))

    def observe_rows(self, rows: int, model_s: float, actual: float) -> float | None:
        """Record a round without layer drafts that verified `rows` positions in `actual`
        seconds, `model_s` predicted. Returns the factor the timings of `rows` rows were scaled
        by, or None."""
        log = math.log(min(max(actual / model_s, 0.5), 2.0))
        decay = self.row_decay
        logs = self.row_logs.setdefault(rows, [0.0, 0.0, 0.0, 0.0])
        logs[:] = (
            decay * logs[0] + log,
            decay * logs[1] + log * log,
            decay * logs[2] + 1.0,
            decay * decay * logs[3] + 1.0,
        )
        plain = self.row_logs.get(1)
        if rows == 1 or plain is None or min(plain[2], logs[2]) < self.row_evidence:
            return None
        (mean, spread), (plain_mean, plain_spread) = _mean_and_error(logs), _mean_and_error(plain)
        gap = mean - plain_mean
        if abs(gap) <= max(
            math.log(self.row_tolerance), NOISE_ERRORS * math.hypot(spread, plain_spread)
        ):
            return None
        factor = math.exp(gap)
        self.cost.correct_rows(rows, factor)
        del self.row_logs[rows]
        self.row_corrections.append((rows, factor))
        return factor

    def observe(self, model_s: float, actual: float, drafted: bool) -> float | None:
        """Record one round: `model_s` seconds predicted by the profile (the cost's grid
        without the policy's overhead), `actual` seconds (drafting and verification). Returns
        the factor the profile was scaled by, or None."""
        if model_s <= 0 or actual <= 0:
            return None
        ratios, ratio = self.ratios[drafted], actual / model_s
        checked = len(ratios) == self.window  # the window without this ratio was (no correction)
        ratios.append(ratio)
        if len(ratios) < self.window:
            return None
        if checked and self.low <= ratio <= self.high and (drafted or self.plain_confirmed):
            return None  # nothing more beyond the bounds than then, nothing left to confirm
        high = [r for r in ratios if r > self.high]
        low = [r for r in ratios if r < self.low]
        beyond = max(high, low, key=len)
        if 4 * len(beyond) < 3 * self.window:
            self.plain_confirmed |= not drafted and not high and not low
            if not drafted:
                self._store_confirmed()
            return None
        factor = statistics.median(beyond)
        profile, drafts_only = self.cost.profile, drafted and self.plain_confirmed
        profile.scale(factor, drafts_only)
        self.cost.rescaled()
        self.plain_confirmed |= not drafted
        ratios.clear()
        self.row_logs.clear()  # predictions changed
        if not drafted:
            self.ratios[True].clear()  # their predictions changed too
        self.corrections.append(factor)
        extreme = factor > self.extreme or factor < 1 / self.extreme
        LOG.info(
            "cost profile disagreed with measured %s rounds (x%.3g); corrected",
            "drafting" if drafted else "plain",
            factor,
        )
        if extreme and profile.path:
            mark_stale(profile.path)
            profile.settled = False
        elif not drafted:
            self.unstored *= factor
        return factor

    def _store_confirmed(self) -> None:
        """A full window of plain steps agreed with the corrected profile: store the square
        root of the corrections not stored yet in its file."""
        if self.unstored != 1.0 and self.cost.profile.path:
            store_correction(self.cost.profile.path, math.sqrt(self.unstored))
        self.unstored = 1.0


def _mean_and_error(sums: list[float]) -> tuple[float, float]:
    """The weighted mean of decayed sums (of values, of their squares, of the weights, of the
    weights' squares) and its standard error."""
    total, squares, weight, weight_squares = sums
    mean = total / weight
    variance = max(squares / weight - mean * mean, 0.0)
    return mean, math.sqrt(variance * weight_squares) / weight
