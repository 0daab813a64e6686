"""Cost models: the paper's layer cost, measured profiles (cached), (E, d) by tokens per second."""

from __future__ import annotations

import copy
import io
import json
import logging
import statistics
import time

import numpy as np
import pytest
import torch
from helpers import profile
from tiny_models import tiny_model
from tqdm import tqdm

from delspec.drafting.draft_head import DraftHead
from delspec.drafting.exit_head import ExitHead
from delspec.machine import cost_profile
from delspec.machine.profile import MachineProfile
from delspec.policies.cost_model import CostCheck, LayerCost, MeasuredCost
from delspec.policies.exit_statistics import best_plan, expected_tokens
from delspec.policies.protocol import Round

LAYERS = 10
EXITS = torch.tensor([2, 5, 8])
LENGTHS = torch.arange(0, 6)


def cached_profile(head, exit_layer, max_tokens, root, thorough=False, budget=None):
    """The profile a new machine profile of `head`'s model (nothing read in this process yet)
    reads or measures under cache root `root`."""
    machine = MachineProfile(head.model, root=root)
    return machine.cost_profile(head, exit_layer, max_tokens, thorough, budget)


def choose(alpha, cost):
    value = expected_tokens(torch.tensor(alpha, dtype=torch.float64), LENGTHS) / cost.grid(
        EXITS, LENGTHS
    )
    row, col = best_plan(value)
    return int(EXITS[row]), int(LENGTHS[col])


def test_measured_cost_by_hand():
    cost = MeasuredCost(profile([1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [0.5] * 6, 0.25), LAYERS)
    grid = cost.grid(EXITS, LENGTHS)
    # d = 0: a plain step, 10 layers * 1.0 + head 0.5
    assert grid[:, 0].tolist() == [10.5] * 3
    # E = 5, d = 2: 2 * (5 * 1.0 + 0.25) + 5 * 1.0 + 5 * layer(3 tokens) 2.0 + head 0.5
    assert grid[1, 2].item() == pytest.approx(10.5 + 5 + 10 + 0.5)
    # then 2 context tokens: the last draft and they run [0, 5) as 3 rows (5 * 2.0), and 5 rows
    # [5, 10) (5 * 3.0); the head, 0.5 per pass over any rows here, as before
    assert cost.round_seconds(5, 2, 0, 0, 2) == pytest.approx(10.5 + 10 + 15 + 0.5)
    assert cost.round_seconds(5, 2, 0, 0, 0) == pytest.approx(grid[1, 2])
    # every prefix in one pass, beyond the profile's rows too
    each = [cost.round_seconds(5, 2, 0, 0, k) for k in range(9)]
    assert cost.after_seconds(5, 2, 0, 8) == pytest.approx(each)
    # no layer draft: nothing for context tokens to follow
    assert cost.round_seconds(0, 0, 0, 0, 2) == pytest.approx(cost.plain_seconds(1))


def test_what_a_verification_leaves_to_the_steps_after_is_part_of_its_cost():
    """k rows through every layer cost their own time and what they leave to the steps after
    (`lingering`); after layer drafts from exit E, the share of the layers [E, L) that ran over
    every row; drafts from the final layer verify in the head alone and leave nothing."""
    p = profile([1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [0.5] * 6, 0.25)
    p.lingering = [0.0, 0.2, 0.4, 0.8, 1.6, 3.2]
    cost = MeasuredCost(p, LAYERS)
    assert cost.plain_seconds(1) == pytest.approx(10.5)
    assert cost.plain_seconds(3) == pytest.approx(20.5 + 0.4)
    assert cost.lingering_of(0, 0, 0, 2) == pytest.approx(0.4)
    assert cost.round_seconds(0, 0, 0, 2) == pytest.approx(cost.plain_seconds(3))
    grid = cost.grid(EXITS, LENGTHS)
    # E = 5, d = 2: 3 rows through [5, 10), half the layers: half of what 3 rows leave
    assert grid[1, 2].item() == pytest.approx(10.5 + 5 + 10 + 0.5 + 0.2)
    assert cost.lingering_of(5, 2, 0, 0) == pytest.approx(0.2)
    assert cost.lingering_of(LAYERS, 2, 0, 0) == 0.0  # drafts from the final layer
    p.scale(2.0)
    cost.rescaled()
    assert cost.lingering_of(0, 0, 0, 2) == pytest.approx(0.8)


def test_cost_check_expects_the_steps_after_a_long_verification_to_be_slow():
    """Plain steps after rounds of 6 rows that take what those rounds left them (half of it in
    the next round, a quarter in the one after, ...) are as predicted: no correction, however
    long it goes on. A profile that knows nothing of it reads the same rounds as 6 rows
    cheaper than it says beside slow plain steps, and corrects them."""

    def round_of(context: int, seconds: float) -> Round:
        return Round(
            0, 0, list(range(context)), [1.0] * context, 0, [0], torch.zeros(context + 1),
            from_context=context, verify_s=seconds,
        )  # fmt: skip

    def checked(knows: bool) -> CostCheck:
        p = profile([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], [0.5] * 6, 0.25)
        p.lingering = [0.0] * 5 + [9.0] if knows else []
        p.path = "measured"  # as if timed on this machine (hand-made ones are kept)
        cost = MeasuredCost(p, LAYERS)
        six, plain, left = 10 * 1.5 + 0.5, 10.5, 0.0
        for _ in range(40):
            cost.check.observe_round(round_of(5, six + 0.5 * left))
            left = 0.5 * left + 9.0
            for _ in range(3):
                cost.check.observe_round(round_of(0, plain + 0.5 * left))
                left *= 0.5
        return cost.check

    knowing = checked(True)
    assert knowing.corrections == [] and knowing.row_corrections == []
    ((rows, factor),) = checked(False).row_corrections[:1]
    assert rows == 6 and factor < 0.85


def test_policy_work_is_charged_by_the_kind_of_round():
    """Rounds that draft from a layer carry the policy's `layer_overhead`, the others (plain
    steps, context drafts alone) its `overhead`: grid, one cell and plain rows agree."""
    cost = MeasuredCost(profile([1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [0.5] * 6, 0.25), LAYERS)
    bare = cost.grid(EXITS, LENGTHS)
    cost.overhead, cost.layer_overhead = 0.1, 0.7
    grid = cost.grid(EXITS, LENGTHS)
    assert grid[:, 0] - bare[:, 0] == pytest.approx([0.1] * 3)
    assert grid[:, 1:] - bare[:, 1:] == pytest.approx(np.full((3, 5), 0.7))
    assert cost.round_seconds(5, 2, 0, 0) == pytest.approx(grid[1, 2])
    assert cost.round_seconds(0, 0, 0, 2) == pytest.approx(cost.plain_seconds(3))
    assert cost.plain_seconds(3) == pytest.approx(10 * 2.0 + 0.5 + 0.1)


def test_rounds_cost_more_further_into_a_sequence():
    """Each position of context adds the profile's slope to every layer timing: a plain step
    after 100 more positions costs 10 layers * 100 * slope more."""
    p = profile([1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [0.5] * 6, 0.25, draft_layer=0.8)
    p.context, p.layer_slope, p.draft_layer_slope = 128, [0.001 * k for k in range(1, 7)], 0.002
    cost = MeasuredCost(p, LAYERS)
    near = cost.grid(EXITS, LENGTHS)
    assert near[:, 0].tolist() == [10.5] * 3 and cost.plain_seconds(3) == pytest.approx(20.5)
    cost.at(64)  # before the profile's own context: no cheaper than there
    assert np.array_equal(cost.grid(EXITS, LENGTHS), near)
    cost.at(228)
    far = cost.grid(EXITS, LENGTHS)
    assert far[:, 0].tolist() == pytest.approx([10.5 + 10 * 100 * 0.001] * 3)
    assert cost.plain_seconds(3) == pytest.approx(20.5 + 10 * 100 * 0.003)
    # E = 5, d = 2: drafts through 5 layers at 0.8 + 0.2, the last one through 5 layers at
    # 1.0 + 0.1, the rest through 5 layers over 3 rows at 2.0 + 0.3, head 0.5
    assert far[1, 2].item() == pytest.approx(2 * (5 * 1.0 + 0.25) + 5 * 1.1 + 5 * 2.3 + 0.5)
    p.scale(2.0)  # a correction: the slopes scale with the timings
    cost.rescaled()
    assert cost.grid(EXITS, LENGTHS)[:, 0].tolist() == pytest.approx([21.0 + 2.0] * 3)


def test_measured_cost_of_int8_drafts_by_hand():
    layer = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    cost = MeasuredCost(profile(layer, [0.5] * 6, 0.25, draft_layer=0.3, int8=True), LAYERS)
    grid = cost.grid(EXITS, LENGTHS)
    assert grid[:, 0].tolist() == [10.5] * 3  # a plain step is the same
    # E = 5, d = 2: 2 * (5 * 0.3 + 0.25) + all 10 layers over 3 tokens (2.0 each) + head 0.5
    assert grid[1, 2].item() == pytest.approx(3.5 + 20 + 0.5)


def test_verification_that_is_not_free_makes_no_draft_best():
    # CPU-like: verifying k tokens costs nearly k plain steps, so drafting cannot pay.
    cost = MeasuredCost(
        profile([1.0, 1.9, 2.8, 3.7, 4.6, 5.5], [0.5 * k for k in range(1, 7)]), LAYERS
    )
    assert choose([0.3, 0.6, 0.9], cost) == (2, 0)  # d = 0: every exit is a plain step
    # The paper's layer-count model ignores that and drafts.
    assert choose([0.3, 0.6, 0.9], LayerCost(LAYERS))[1] > 0


def test_cheap_verification_picks_the_best_layer_and_length():
    # GPU-like: verification of up to 6 tokens costs one step; a late layer accepts well.
    cost = MeasuredCost(profile([1.0] * 6, [0.5] * 6), LAYERS)
    # E = 8: cost(d) = 8.001 d + 10.5; tokens(d) = (1 - 0.95^(d+1)) / 0.05
    # d=1: 1.95 / 18.501 = .1054; d=2: 2.8525 / 26.502 = .1076; d=3: 3.7099 / 34.503 = .1075
    assert choose([0.2, 0.5, 0.95], cost) == (8, 2)
    # With a cheap early layer that accepts as well, drafting longer pays.
    assert choose([0.95, 0.5, 0.2], cost) == (2, 5)


class CountingHead(ExitHead):
    calls = 0

    def __call__(self, h, exit_layer, level=0):
        CountingHead.calls += 1
        return super().__call__(h, exit_layer, level)


def test_profile_is_measured_once_then_cached_and_refreshed_when_stale(tmp_path):
    head = CountingHead(tiny_model(seed=0))
    first = cached_profile(head, 2, 4, tmp_path)
    assert len(first.layer) == 4 and all(t > 0 for t in first.layer + first.head)
    assert first.draft_layer > 0 and not first.int8
    assert first.context > 0 and len(first.layer_slope) == 4
    assert all(t >= 0 for t in first.layer_slope) and first.draft_layer_slope >= 0
    assert all(t >= 0 for t in first.draft_head)  # a pass and the head, less a pass alone
    rows = [MeasuredCost(first, head.model.num_layers).plain_seconds(k) for k in range(1, 5)]
    assert rows == sorted(rows)  # verifying more rows never reads as cheaper
    measured = CountingHead.calls
    again = cached_profile(head, 2, 4, tmp_path)
    assert CountingHead.calls == measured and again == first
    path = next((tmp_path / "costs").glob("profile-*.json"))
    data = json.loads(path.read_text())
    data["measured_at"] = time.time() - 30 * 24 * 3600
    path.write_text(json.dumps(data))
    cached_profile(head, 2, 4, tmp_path)
    assert CountingHead.calls > measured  # a month-old profile is measured again
    path.write_text("{not json")
    assert cached_profile(head, 2, 4, tmp_path).key == first.key
    # int8 drafts are another setting: a profile of their own
    int8 = cached_profile(ExitHead(head.model, int8=True), 2, 4, tmp_path)
    assert (
        int8.int8 and int8.key != first.key and len(list((tmp_path / "costs").glob("*.json"))) == 2
    )


def test_a_profile_is_timed_from_the_most_rows_down_and_takes_rows_as_decoding_meets_them(
    monkeypatch,
):
    """The runs take turns from the most rows to the fewest (a one-row run never comes right
    after a long one); k rows through every layer and the head cost what decoding measured in
    proportion to a plain step (`measure_in_decoding`), their head what they took beyond the
    layers alone (at least half the head timed alone: a head timed alone 2x slow for one row
    does not make its layers read cheap), the layers the rest; what they leave to the steps
    after is kept apart, in seconds."""
    model = tiny_model(seed=0)
    layers = model.num_layers
    orders = []

    def rows_of(key):
        return 1 if key == "step" or key[0] == "drafted" else key[-1]

    def timings(runs, rounds, device=None):
        if not isinstance(next(iter(runs)), tuple):  # the draft heads' runs
            return dict.fromkeys(runs, 0.001), True
        orders.append([rows_of(key) for key in runs])
        seconds = {}
        for key in runs:
            k = rows_of(key)
            alone = 0.1 if k == 1 else 0.05  # one row's head timed alone 2x slow
            kind = "step" if key == "step" else key[0]
            seconds[key] = {"layer": 0.1 * k, "drafted": 0.1, "step": 0.15}.get(kind, alone)
        return seconds, True

    in_steps, lingering = [1.0, 1.6, 2.2, 2.8], [0.0, 0.1, 0.2, 0.4]
    monkeypatch.setattr(cost_profile, "settled_seconds", timings)
    monkeypatch.setattr(cost_profile, "measure_in_decoding", lambda *a, **k: (in_steps, lingering))
    measured = cost_profile.measure_profile(ExitHead(model), 2, 4, context=8, far=16)
    (rows,) = orders
    assert rows == sorted(rows, reverse=True) and rows[0] == 4 and rows[-1] == 1
    totals = [layers * t + h for t, h in zip(measured.layer, measured.head, strict=True)]
    assert totals == pytest.approx([0.15 * k for k in in_steps])
    assert measured.head[0] == pytest.approx(0.05) and min(measured.head) >= 0.025
    assert measured.lingering == pytest.approx([0.15 * g for g in lingering])


def test_a_profile_times_a_sample_of_row_counts_and_interpolates_between(monkeypatch):
    """Layers and head are timed at `row_counts` (and the far slope's counts) only; the other
    row counts are interpolated between them."""
    model = tiny_model(seed=0)
    layers, timed = model.num_layers, []

    def timings(runs, rounds, device=None):
        if not isinstance(next(iter(runs)), tuple):  # the draft heads' runs
            return dict.fromkeys(runs, 0.001), True
        timed.extend(key for key in runs if key != "step")
        return {key: seconds(key) for key in runs}, True

    def seconds(key):  # a step 0.15 s, a draft pass 0.1 s, k rows 0.1 k (layers), 0.02 k (head)
        if key == "step" or key[0] == "drafted":
            return 0.15 if key == "step" else 0.1
        return {"layer": 0.1, "head": 0.02}[key[0]] * key[-1]

    monkeypatch.setattr(cost_profile, "settled_seconds", timings)
    in_steps = [float(k) for k in range(1, 13)]  # k rows cost k plain steps in decoding
    monkeypatch.setattr(cost_profile, "measure_in_decoding", lambda *a, **k: (in_steps, [0.0] * 12))
    measured = cost_profile.measure_profile(ExitHead(model), 2, 12, context=8, far=16)
    near = {key[-1] for key in timed if key[:2] == ("layer", 8)}
    heads = {key[-1] for key in timed if key[0] == "head"}
    assert near == heads == set(cost_profile.row_counts(12)) | {1, 6, 12} and 11 not in near
    assert len(measured.layer) == len(measured.head) == 12
    # k rows: 0.15 k in all, 0.1 k of it the layers alone, at 11 rows as at the timed ones
    assert measured.layer == pytest.approx([0.1 * k / layers for k in range(1, 13)])
    assert measured.head == pytest.approx([0.05 * k for k in range(1, 13)])


def test_a_quick_profile_times_few_row_counts_in_one_take_and_one_cycle(monkeypatch):
    """A quick profile: layers and head at `quick_counts` (and the far slope's counts), one
    take of `QUICK_ROUNDS` rounds, one cycle in decoding without an untimed one, one step after
    each round, fewer rounds of draft heads; a thorough one at `row_counts`, until two takes
    agree, as many cycles as the budget holds."""
    model = tiny_model(seed=0)
    calls, picks = [], []

    def timings(runs, rounds, device=None, tries=3, warm=True):
        calls.append((rounds, tries, warm, sorted(key[-1] for key in runs if key[0] == "head")))
        return dict.fromkeys(runs, 0.01), True

    def in_decoding(model, states, context, cycles, **options):
        calls.append((cycles, options["warm"], options["linger"], options["counts"]))
        picks.append(options["pick"])
        return [1.0 + k for k in range(len(states))], [0.0] * len(states)

    def draft_heads(head, exit_layer, rounds):
        calls.append(rounds)
        return [0.001], True

    monkeypatch.setattr(cost_profile, "settled_seconds", timings)
    monkeypatch.setattr(cost_profile, "measure_in_decoding", in_decoding)
    monkeypatch.setattr(cost_profile, "measure_draft_heads", draft_heads)
    quick = cost_profile.measure_profile(ExitHead(model), 2, 12, context=8, far=16, quick=True)
    counts = cost_profile.quick_counts(12)
    assert counts == [1, 2, 4, 6, 12] and quick.quick and len(quick.layer) == 12
    assert calls == [
        (cost_profile.QUICK_ROUNDS, 1, False, counts),
        (cost_profile.QUICK_CYCLES, False, 1, counts),
        cost_profile.QUICK_DRAFT_HEAD_ROUNDS,
    ]
    assert picks == [min]
    calls.clear()
    thorough = cost_profile.measure_profile(ExitHead(model), 2, 12, context=8, far=16)
    every = cost_profile.row_counts(12)
    assert not thorough.quick and len(every) > len(counts)
    assert calls == [
        (3, 3, True, sorted({*every, 6})),
        (cost_profile.IN_DECODING_CYCLES, True, cost_profile.LINGER_STEPS, every),
        cost_profile.DRAFT_HEAD_ROUNDS,
    ]
    assert picks == [min, statistics.median]


def test_a_first_profile_is_quick_and_a_thorough_one_replaces_it_when_asked(tmp_path):
    """Measured quick where none is stored; asked for a thorough one, a quick one is measured
    again thoroughly (draft heads too) and stored; a thorough one serves either ask."""
    head = CountingHead(tiny_model(seed=0))
    quick = cached_profile(head, 2, 4, tmp_path)
    assert quick.quick and cached_profile(head, 2, 4, tmp_path).quick
    measured = CountingHead.calls
    thorough = cached_profile(head, 2, 4, tmp_path, thorough=True)
    assert not thorough.quick and CountingHead.calls > measured
    (path,) = (tmp_path / "costs").glob("profile-*.json")
    assert json.loads(path.read_text())["quick"] is False
    measured = CountingHead.calls
    for ask in (True, False):
        again = cached_profile(head, 2, 4, tmp_path, thorough=ask)
        assert again == thorough and not again.quick and CountingHead.calls == measured


def test_a_run_too_short_to_repay_a_profile_measures_none(tmp_path):
    """A run allowed fewer new tokens than a quick profile takes steps gets no profile and
    stores none; a longer one measures it, and then every run reads it, however short. A
    thorough profile is measured whatever the run."""
    head = CountingHead(tiny_model(seed=0))
    short = cost_profile.QUICK_PROFILE_STEPS - 1
    calls = CountingHead.calls
    assert cached_profile(head, 2, 4, tmp_path, budget=short) is None
    assert CountingHead.calls == calls and not list(tmp_path.glob("costs/profile-*"))
    measured = cached_profile(head, 2, 4, tmp_path, budget=cost_profile.QUICK_PROFILE_STEPS)
    assert measured is not None and measured.quick
    assert cached_profile(head, 2, 4, tmp_path, budget=1) == measured
    elsewhere = tmp_path / "other"
    thorough = cached_profile(head, 2, 4, elsewhere, thorough=True, budget=1)
    assert thorough is not None and not thorough.quick


def test_short_runs_measure_a_profile_once_their_budgets_add_up_to_one(tmp_path):
    """Runs each too short to repay a quick profile count the new tokens they were allowed, in
    the cache (so across processes: each machine profile here is a new one); the run at which
    the count reaches `QUICK_PROFILE_STEPS` measures the profile, and the count starts again."""
    head = CountingHead(tiny_model(seed=0))
    steps = cost_profile.QUICK_PROFILE_STEPS
    budgets = [steps // 3, steps // 3, steps - 2 * (steps // 3) - 1]  # one token short
    calls = CountingHead.calls
    for budget in budgets:
        assert cached_profile(head, 2, 4, tmp_path, budget=budget) is None
    assert CountingHead.calls == calls and not list(tmp_path.glob("costs/profile-*"))
    measured = cached_profile(head, 2, 4, tmp_path, budget=1)  # the count reaches it
    assert measured is not None and measured.quick and CountingHead.calls > calls
    assert list(tmp_path.glob("costs/profile-*")) and not list(tmp_path.glob("costs/pending-*"))
    assert cached_profile(head, 2, 4, tmp_path, budget=1) == measured
    # an unreadable count starts again from zero
    fresh = tmp_path / "fresh"
    assert cached_profile(head, 2, 4, fresh, budget=steps - 1) is None
    (pending,) = fresh.glob("costs/pending-*.json")
    pending.write_text("not json")
    assert cached_profile(head, 2, 4, fresh, budget=steps - 1) is None


def test_a_machine_profile_keys_its_measurements_by_its_thread_count_and_keeps_what_it_read(
    tmp_path,
):
    """The thread count is part of every key (a profile timed on two threads says nothing of
    one); within a process, a machine profile hands out the profile it read or measured."""
    model = tiny_model(seed=0)
    one, two = MachineProfile(model, 1, tmp_path), MachineProfile(model, 2, tmp_path)
    assert one.key() != two.key() and one.key() == MachineProfile(model, 1).key()
    head = ExitHead(model)
    first = one.cost_profile(head, 2, 4)
    assert one.cost_profile(head, 2, 4) is first and first.key != two.cost_profile(head, 2, 4).key
    assert len(list((tmp_path / "costs").glob("profile-*.json"))) == 2


@pytest.mark.parametrize(
    ("budget_s", "timed"), [(0.0, cost_profile.IN_DECODING_MIN_CYCLES), (1e9, 5)]
)
def test_cycles_in_decoding_are_as_many_as_the_budget_holds(budget_s, timed):
    """At the untimed cycle's pace, as many timed cycles as `budget_s` holds, no fewer than the
    least and no more than asked; the progress bar counts every cycle and the draft heads."""
    model = tiny_model(seed=0)
    bar = tqdm(total=1, file=io.StringIO())
    with model.scratch_cache(64), torch.inference_mode():
        states = model.embed(torch.arange(4))
        cost_profile.measure_in_decoding(model, states, 16, cycles=5, budget_s=budget_s, bar=bar)
    assert (bar.n, bar.total) == (timed + 1, timed + 2)


def test_what_rounds_leave_is_one_line_through_noisy_medians():
    """A trend across the row counts is kept; one count's noise is not what every larger
    round is priced at."""
    counts = [1, 2, 3, 4, 8]
    assert cost_profile.lingering_line(counts, [0.0, 0.1, 0.2, 0.3, 0.7], 9) == pytest.approx(
        [0.1 * k for k in range(9)]
    )
    noisy = cost_profile.lingering_line(counts, [0.5, 0.4, 0.0, 0.0, 0.0], 9)
    assert noisy[0] == 0.0 and max(noisy) < 0.1  # (0.4 at 2 rows alone)
    assert cost_profile.lingering_line(counts, [0.0, -0.2, 0.1, -0.1, 0.0], 9) == [0.0] * 9
    assert cost_profile.lingering_line([1], [0.3], 3) == [0.0] * 3


def test_rows_in_decoding_are_a_plain_step_apart():
    """On a real (tiny) model: one row is the plain step itself, more rows cost no less than
    fewer, and what a round leaves to the steps after is none for one row, never negative."""
    model = tiny_model(seed=0)
    with model.scratch_cache(64), torch.inference_mode():
        states = model.embed(torch.arange(9))
        in_steps, lingering = cost_profile.measure_in_decoding(model, states, 16, cycles=2)
    assert len(in_steps) == len(lingering) == 9 and in_steps[0] == 1.0
    assert in_steps == sorted(in_steps) and lingering[0] == 0.0
    assert lingering == sorted(lingering) and min(lingering) >= 0.0


def test_heads_of_other_vocabularies_share_the_model_timings(tmp_path):
    model = tiny_model(seed=0)
    full = cached_profile(ExitHead(model), 2, 4, tmp_path)
    pruned = cached_profile(DraftHead(model, vocab=[torch.arange(8), None]), 2, 4, tmp_path)
    assert (pruned.key, pruned.layer, pruned.head) == (full.key, full.layer, full.head)
    assert len(full.draft_head) == 1 and len(pruned.draft_head) == 2
    (path,) = (tmp_path / "costs").glob("profile-*.json")
    assert set(json.loads(path.read_text())["draft_heads"]) == {"64", "8,64"}
    assert cached_profile(ExitHead(model), 2, 4, tmp_path) == full


def test_cost_check_corrects_a_profile_that_rounds_disagree_with(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="delspec.policies.cost_model")
    layer, head = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [0.5] * 6
    cost = MeasuredCost(profile(list(layer), list(head), 0.25), LAYERS)
    check = CostCheck(cost, window=16)
    # within [0.7, 1.4] of the prediction: noise, nothing changes
    for ratio in [0.8, 1.3] * 20:
        assert check.observe(10.5, 10.5 * ratio, drafted=False) is None
    assert cost.profile.layer == layer
    # plain steps 2.3x slower than predicted for a sustained stretch (3/4 of the window of 16):
    # every timing scaled
    factors = [check.observe(10.5, 10.5 * 2.3, drafted=False) for _ in range(12)]
    assert factors[:11] == [None] * 11 and factors[11] == pytest.approx(2.3)
    assert cost.profile.layer == pytest.approx([t * 2.3 for t in layer])
    assert cost.profile.head == pytest.approx([t * 2.3 for t in head])
    assert cost.profile.draft_head == pytest.approx([0.25 * 2.3])
    assert "disagreed with measured plain rounds (x2.3); corrected" in caplog.text
    assert capsys.readouterr().err == ""  # logged, never printed into a streamed answer
    # drafting rounds 2x faster than predicted: the timings of drafting from a layer alone
    # (verifying rows is the rows' check's; scaled with the drafts, 2 rows halved would cost
    # less than 1)
    rows = [cost.plain_seconds(k) for k in range(1, 7)]
    for _ in range(16):
        check.observe(20.0, 10.0, drafted=True)
    assert cost.profile.layer == pytest.approx([t * 2.3 for t in layer])
    assert [cost.plain_seconds(k) for k in range(1, 7)] == pytest.approx(rows)
    assert cost.profile.draft_layer == pytest.approx(2.3 * 0.5)
    assert cost.profile.draft_head == pytest.approx([0.25 * 2.3 * 0.5])
    assert check.corrections == pytest.approx([2.3, 0.5])
    assert "disagreed with measured drafting rounds (x0.5)" in caplog.text


def test_context_drafts_alone_are_left_to_the_rows_check_once_plain_steps_agree():
    """Once a window of plain steps agreed with the profile, rounds of context drafts alone
    that run at half their prediction scale no timing as a whole (their rows' own check
    corrects 2 rows); before that, they stand in for the machine's speed and scale them all."""

    def round_of(context: int, seconds: float) -> Round:
        return Round(
            0, 0, list(range(context)), [1.0] * context, 0, [0], torch.zeros(context + 1),
            from_context=context, verify_s=seconds,
        )  # fmt: skip

    for confirmed in (True, False):
        cost = MeasuredCost(profile([1.0, 1.5, 2.0, 2.5], [0.5] * 4, 0.25), LAYERS)
        cost.profile.path = "measured"
        plain, two = cost.plain_seconds(1), cost.plain_seconds(2)
        for _ in range(cost.check.window if confirmed else 0):
            cost.check.observe_round(round_of(0, plain))
        for _ in range(3 * cost.check.window):
            cost.check.observe_round(round_of(1, two * 0.5))
            if confirmed:
                cost.check.observe_round(round_of(0, plain))
        if confirmed:
            assert cost.check.corrections == [] and cost.plain_seconds(1) == plain
            assert [rows for rows, _ in cost.check.row_corrections][:1] == [2]
        else:
            assert cost.check.corrections[0] == pytest.approx(0.5)


def test_cost_check_marks_a_far_off_profile_for_measuring_again(tmp_path):
    head = ExitHead(tiny_model(seed=0))
    measured = cached_profile(head, 2, 4, tmp_path)
    cost = MeasuredCost(measured, head.model.num_layers)
    plain = float(cost.grid(torch.tensor([0]), torch.tensor([0]))[0, 0])
    for _ in range(cost.check.window):  # one full window
        cost.check.observe(plain, plain / 100, drafted=False)
    assert cost.check.corrections == pytest.approx([0.01])
    (path,) = (tmp_path / "costs").glob("profile-*.json")
    assert json.loads(path.read_text())["settled"] is False
    again = cached_profile(head, 2, 4, tmp_path)  # measured afresh, not the far-off file
    assert again.measured_at > measured.measured_at and again.settled in (True, False)


def test_a_correction_is_stored_for_the_next_process(tmp_path):
    """A profile plain steps found 2.25x too fast (not far enough off to measure again) is read
    back corrected by 1.5 (the square root) once the next window of plain steps agrees with
    it, every vocabulary's draft head too, and as old as it was; what drafting rounds then
    correct (it follows what a process drafts) is not stored."""
    model = tiny_model(seed=0)
    measured = cached_profile(ExitHead(model), 2, 4, tmp_path)
    pruned = cached_profile(DraftHead(model, vocab=[torch.arange(8), None]), 2, 4, tmp_path)
    before = copy.deepcopy(measured)  # the correction scales `measured` in place
    cost = MeasuredCost(measured, model.num_layers)
    plain = float(cost.grid(torch.tensor([0]), torch.tensor([0]))[0, 0])
    for _ in range(cost.check.window):  # one full window of plain steps 2.25x the prediction
        cost.check.observe(plain, plain * 2.25, drafted=False)
    assert cost.check.corrections == pytest.approx([2.25])
    assert cached_profile(ExitHead(model), 2, 4, tmp_path).layer == before.layer  # not yet
    for _ in range(cost.check.window):  # plain steps as the corrected profile says: confirmed
        cost.check.observe(plain * 2.25, plain * 2.25, drafted=False)
    again = cached_profile(ExitHead(model), 2, 4, tmp_path)
    assert again.layer == pytest.approx([t * 1.5 for t in before.layer])
    assert again.head == pytest.approx([t * 1.5 for t in before.head])
    assert again.draft_head == pytest.approx([t * 1.5 for t in before.draft_head])
    # as old as it was, and as settled as the last timing (the pruned heads') left it
    assert (again.measured_at, again.settled) == (measured.measured_at, pruned.settled)
    both = cached_profile(DraftHead(model, vocab=[torch.arange(8), None]), 2, 4, tmp_path)
    assert both.draft_head == pytest.approx([t * 1.5 for t in pruned.draft_head])
    for _ in range(cost.check.window):  # drafting rounds 2x the prediction: corrected, not stored
        cost.check.observe(plain, plain * 2.0, drafted=True)
    assert cost.check.corrections == pytest.approx([2.25, 2.0])
    assert cost.profile.draft_layer == pytest.approx(before.draft_layer * 4.5)
    kept = cached_profile(ExitHead(model), 2, 4, tmp_path)
    assert kept.draft_layer == pytest.approx(before.draft_layer * 1.5)


def test_a_passing_stretch_is_not_stored(tmp_path):
    """Plain steps 2x the profile for one window and as it said for the next: the process
    corrects it there and back, and the file keeps what was measured; a correction confirmed
    after the stretch is stored as far as they leave it, and of that the square root."""
    model = tiny_model(seed=0)
    measured = cached_profile(ExitHead(model), 2, 4, tmp_path)
    before = copy.deepcopy(measured)
    cost = MeasuredCost(measured, model.num_layers)
    plain = float(cost.grid(torch.tensor([0]), torch.tensor([0]))[0, 0])
    window = cost.check.window
    for _ in range(window):  # plain steps 2x the profile: corrected in the process
        cost.check.observe(plain, 2 * plain, drafted=False)
    for _ in range(window):  # then as it was measured: corrected back
        cost.check.observe(2 * plain, plain, drafted=False)
    assert cost.check.corrections == pytest.approx([2.0, 0.5])
    for _ in range(window):  # a window that agrees: the net correction (none) is confirmed
        cost.check.observe(plain, plain, drafted=False)
    assert cached_profile(ExitHead(model), 2, 4, tmp_path).layer == pytest.approx(before.layer)
    for _ in range(window):
        cost.check.observe(plain, plain * 2.25, drafted=False)
    for _ in range(window):
        cost.check.observe(plain * 2.25, plain * 2.25, drafted=False)
    stored = cached_profile(ExitHead(model), 2, 4, tmp_path)
    assert stored.layer == pytest.approx([t * 1.5 for t in before.layer])


def test_rows_corrected_below_fewer_rows_bring_those_down():
    """A correction that makes 4 rows cheaper than 2 and 3 (never verified) lowers them to 4
    rows' cost, rather than 4 rows being raised back to theirs; one row stays as it was, and
    more rows are no cheaper than fewer."""
    cost = MeasuredCost(profile([1.0, 1.05, 1.1, 1.3, 1.5], [0.5] * 5), LAYERS)
    before = [cost.plain_seconds(k) for k in range(1, 6)]  # 10.5, 11.0, 11.5, 13.5, 15.5
    cost.correct_rows(4, 0.8)
    after = [cost.plain_seconds(k) for k in range(1, 6)]
    assert after[3] == pytest.approx(before[3] * 0.8)  # 10.8
    assert after[1] == pytest.approx(after[3]) and after[2] == pytest.approx(after[3])
    assert after[0] == before[0] and after[4] == before[4]
    cost.correct_rows(4, 0.5)  # under one row: raised to a plain step's cost, no cheaper
    assert cost.plain_seconds(2) == pytest.approx(before[0])
    assert cost.plain_seconds(4) == pytest.approx(before[0])


def test_cost_check_corrects_the_rows_the_profile_got_wrong():
    """Rounds verifying 2 rows that take 1.38x what the profile says (within the band the
    sustained-stretch check lets pass), while plain steps timed in the same stretch take 1.1x,
    scale the timings of 2 rows by about 1.38 / 1.1, and 3 rows then cost no less than 2;
    drift alone (with 2 rows 5% off) changes nothing."""
    layer, head = [1.0, 1.05, 1.1, 1.3, 1.5, 1.7], [0.5] * 6
    cost = MeasuredCost(profile(list(layer), list(head), 0.25), LAYERS)
    cost.profile.path = "measured"  # as if timed on this machine (hand-made ones are kept)
    check = cost.check

    def round_of(context: int, seconds: float) -> Round:
        drafted = list(range(context))
        return Round(
            0,
            0,
            drafted,
            [1.0] * context,
            0,
            [0],
            torch.zeros(context + 1),
            from_context=context,
            verify_s=seconds,
        )

    plain, two = cost.plain_seconds(1), cost.plain_seconds(2)
    for ratio in (1.2, 1.25, 1.15) * 4:  # drift: plain steps and 2 rows alike
        check.observe_round(round_of(0, plain * ratio))
        check.observe_round(round_of(1, two * ratio * 1.05))
    assert check.row_corrections == [] and cost.plain_seconds(2) == two
    for _ in range(30):
        check.observe_round(round_of(0, plain * 1.1))
        check.observe_round(round_of(1, two * 1.38))
        if check.row_corrections:
            break
    ((rows, factor),) = check.row_corrections
    assert rows == 2 and 1.15 < factor <= 1.38 / 1.1
    assert check.corrections == []  # the profile as a whole was not off
    assert cost.plain_seconds(2) == pytest.approx(two * factor)
    assert cost.plain_seconds(1) == plain
    assert cost.plain_seconds(3) >= cost.plain_seconds(2)  # 11.5 before, under 11.0 * 1.15
    assert cost.grid([0], [0], context=1)[0, 0] == pytest.approx(cost.plain_seconds(2))


def test_cost_check_leaves_rows_whose_gap_is_within_the_noise():
    """Rounds of 3 rows 1.2x dearer than the profile beside plain steps (beyond the tolerance)
    are not corrected while single rounds scatter by +-25%, as on a busy host; the same gap
    with a scatter of +-2% is."""
    for scatter, corrected in ((1.25, False), (1.02, True)):
        cost = MeasuredCost(profile([1.0, 1.05, 1.1, 1.3], [0.5] * 4, 0.25), LAYERS)
        cost.profile.path = "measured"
        plain, three = cost.plain_seconds(1), cost.plain_seconds(3)
        for noise in (scatter, 1 / scatter) * 10:
            cost.check.observe_rows(1, plain, plain * noise)
            cost.check.observe_rows(3, three, three * 1.2 / noise)
        assert bool(cost.check.row_corrections) == corrected


def test_a_new_vocabulary_keeps_an_unsettled_profile_unsettled(tmp_path):
    """Timing another vocabulary's draft heads leaves a profile whose takes did not agree
    marked so (measured again within the hour), where it was marked settled for a week."""
    model = tiny_model(seed=0)
    cached_profile(ExitHead(model), 2, 4, tmp_path)
    (path,) = (tmp_path / "costs").glob("profile-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "settled": False}))
    pruned = cached_profile(DraftHead(model, vocab=[torch.arange(8), None]), 2, 4, tmp_path)
    assert not pruned.settled and json.loads(path.read_text())["settled"] is False


def test_draft_heads_are_priced_from_paired_differences() -> None:
    """A level's price is the median over rounds of its pass less the same round's pass alone:
    a busy stretch that slows both (here every fourth round, 3x) moves neither, where the
    fastest of each timed apart would mix moments; a larger vocabulary never reads cheaper; the
    rounds' two halves agree unless the machine's noise falls on one of them."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(16):
        slow = 3.0 if i % 4 == 0 else 1.0
        jitter = rng.uniform(0.0, 2e-5, 3)
        samples.append(
            [
                slow * 4e-3 + jitter[0],
                slow * 4e-3 + 5e-4 + jitter[1],
                slow * 4e-3 + 4e-4 + jitter[2],
            ]
        )
    prices, settled = cost_profile.head_costs(samples)
    assert settled
    assert prices[0] == pytest.approx(5e-4, abs=2e-5)
    assert prices[1] == prices[0]  # the larger vocabulary read cheaper: raised to the smaller's
    for row in samples[8:]:  # the second half: the heads twice as dear
        row[1] += 5e-4
        row[2] += 5e-4
    assert not cost_profile.head_costs(samples)[1]
