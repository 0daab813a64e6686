"""Cost models for choosing the exit layer and draft length: what one round costs.

`LayerCost` is the paper's (layer loads). `MeasuredCost` uses the seconds of a cost profile
measured on this machine (`delspec.machine.cost_profile`). `CostCheck` compares a run's rounds
with the profile's predictions and corrects the profile (and marks its file for measuring again)
when they disagree for a sustained stretch: a profile timed while the machine was busy would
otherwise mislead every later run that reads it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from delspec.machine.cost_profile import CostProfile
from delspec.machine.store import mark_stale, store_correction
from delspec.policies.protocol import Round

Array = np.ndarray
Ints = Sequence[int] | np.ndarray  # exit layers, draft lengths or vocabulary levels

LOG = logging.getLogger(__name__)
# The share of what a round leaves to the steps after it that shows in the next one (`CostCheck`).
LINGER_SHARE = 0.5
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


class MeasuredCost:
    """Round cost in seconds from a `CostProfile`, plus the policy's own work per round.

    That work is kept apart for rounds that draft from an exit layer (`layer_overhead`) and
    the others (`overhead`): counting a layer's drafts and choosing the plan again cost several
    times a plain step's bookkeeping, a good share of what a one-token layer draft saves, and
    one figure for both would make layer drafts look cheaper and plain steps dearer than they
    are.

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
        alone, a count would be raised back to its uncorrected neighbour's cost, corrected again
        and again while its cost stayed where it was."""
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
    rows' timings scaled with the drafts', drafts from a final layer that ran well under their
    prediction would price verifying a few rows at a plain step's cost, and every context draft
    would look free. The window then starts afresh. A factor beyond
    `extreme` (or its inverse) also marks the profile's file stale, so that the next run
    measures it again; any other correction from plain steps is stored in the file
    (`store_correction`), so that the next process starts from it (a profile timed in a loop
    can read too fast for the rounds of every process, each correcting it anew): once the next
    full window of plain steps agrees with the corrected profile, the square root of the
    corrections made since the last store (a stretch that one window saw and the next did not
    leaves nothing; the next process starts halfway, in log terms, and corrects the rest if it
    holds: stored whole, processes in a row can each undo the one before). One from drafting
    rounds is not stored: how far drafting rounds are off follows what the process drafted,
    and stored, it would price the next process's plain steps too, and the processes after it
    would choose differently from the same prompts. Each correction is
    logged (logger `delspec.policies.cost_model`, level INFO: not printed into a streamed answer).

    Rounds without layer drafts (plain steps, context drafts alone) are also kept by the rows
    they verify: a decayed mean (by `row_decay` per such round) of the log of actual /
    predicted, each ratio taken within [1/2, 2] (a round an interruption stretched counts no
    more than that), with its standard error. Once rounds of k > 1 rows and plain steps each
    have `row_evidence` (decayed) rounds and k rows' mean is beyond `row_tolerance` of the plain
    steps' and beyond `NOISE_ERRORS` standard errors of their difference, the timings of k rows
    are scaled by the quotient (`MeasuredCost.correct_rows`) and k's mean starts afresh.
    Relative to plain steps timed in the same stretch, the machine's drift cancels out: what is
    left is what the profile got wrong about several rows (a few rows priced too cheap let
    context drafts through that cannot pay; where the profile is right, this stays quiet). On
    a busy host single rounds scatter widely, and with the tolerance alone row counts would be
    corrected one way and then back the other in one process.
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
