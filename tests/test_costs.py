"""Cost models: measured profiles, (E, d) selection by tokens per second, no-draft rounds."""

from __future__ import annotations

import json
import time

import pytest
import torch
from tiny_models import tiny_model

from delspec.costs import CostProfile, LayerCost, MeasuredCost, cached_profile
from delspec.engine import ExitHead
from delspec.exit_statistics import best_plan, expected_tokens
from delspec.generate import decode_tokens
from delspec.policies import make_policy

LAYERS = 10
EXITS = torch.tensor([2, 5, 8])
LENGTHS = torch.arange(0, 6)


def profile(layer, head, draft_head=0.001, draft_layer=None, int8=False):
    return CostProfile(
        layer=layer,
        head=head,
        draft_layer=layer[0] if draft_layer is None else draft_layer,
        draft_head=draft_head,
        int8=int8,
        key="test",
        measured_at=0,
    )


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


def test_no_draft_rounds_with_a_profile_where_drafting_cannot_pay(tmp_path, monkeypatch):
    model = tiny_model(seed=0, shallow=2)
    policy = make_policy("del", model.num_layers, cost="measured", no_draft=True)
    # verifying k tokens costs k plain steps: even always-accepted drafts cannot pay
    slow = profile([1.0 * k for k in range(1, 21)], [0.1 * k for k in range(1, 21)], 0.5)
    policy.cost = MeasuredCost(slow, model.num_layers)
    prompt = list(range(3, 20))
    expected = decode_tokens(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=30)
    got = decode_tokens(model, prompt, policy, max_new_tokens=30, trace=True)
    assert got.token_ids == expected.token_ids
    plain = [r for r in got.trace if r["exit_layer"] == 0]
    assert len(plain) >= 25  # after the warm-up round, every round is a plain step
    # statistics keep updating from plain steps: alpha changes between plain rounds
    assert plain[0]["alpha"] != plain[-1]["alpha"]


class CountingHead(ExitHead):
    calls = 0

    def __call__(self, h, exit_layer):
        CountingHead.calls += 1
        return super().__call__(h, exit_layer)


def test_profile_is_measured_once_then_cached_and_refreshed_when_stale(tmp_path):
    head = CountingHead(tiny_model(seed=0))
    first = cached_profile(head, 2, 4, tmp_path)
    assert len(first.layer) == 4 and all(t > 0 for t in first.layer + first.head)
    assert first.draft_layer > 0 and not first.int8
    measured = CountingHead.calls
    again = cached_profile(head, 2, 4, tmp_path)
    assert CountingHead.calls == measured and again == first
    path = next(tmp_path.glob("profile-*.json"))
    data = json.loads(path.read_text())
    data["measured_at"] = time.time() - 30 * 24 * 3600
    path.write_text(json.dumps(data))
    cached_profile(head, 2, 4, tmp_path)
    assert CountingHead.calls > measured  # a month-old profile is measured again
    path.write_text("{not json")
    assert cached_profile(head, 2, 4, tmp_path).key == first.key
    # int8 drafts are another setting: a profile of their own
    int8 = cached_profile(ExitHead(head.model, int8=True), 2, 4, tmp_path)
    assert int8.int8 and int8.key != first.key and len(list(tmp_path.glob("*.json"))) == 2


def test_shadow_budget_bounds_policy_work_and_stays_lossless():
    model = tiny_model(seed=3, shallow=2)
    prompt = list(range(1, 30))
    expected = decode_tokens(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=60)
    policy = make_policy("del", model.num_layers, shadow_budget=0.05, no_draft=True)
    got = decode_tokens(model, prompt, policy, max_new_tokens=60, trace=True)
    assert got.token_ids == expected.token_ids
    scored = [r for r in got.trace[1:] if r["scored_layers"]]
    assert len(scored) < len(got.trace) - 1  # some rounds skip scoring entirely


def _policy_with_counts(matched, mismatched, **options):
    """A measured-cost DEL over exits 2, 5, 8 of a 10-layer model with given decayed counts."""
    model = tiny_model(seed=0, num_layers=LAYERS)
    policy = make_policy("del", LAYERS, candidates=EXITS.tolist(), cost="measured", **options)
    policy.cost = MeasuredCost(profile([1.0] * 20, [0.5] * 20), LAYERS)  # GPU-like
    policy.start(ExitHead(model))
    policy.stats.matched = torch.tensor(matched, dtype=torch.float64)
    policy.stats.mismatched = torch.tensor(mismatched, dtype=torch.float64)
    policy._choose()
    return policy


def test_a_draft_must_promise_the_margin_over_a_plain_step():
    # alpha(8) = 0.95: E = 8, d = 2 gives 13% more tokens/s than a plain step, above the margin
    policy = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0)
    assert (policy.plan().exit_layer, policy.plan().draft_cap) == (8, 2)
    # alpha(8) = 0.84: the best draft (E = 8, d = 1) gains 4.4%, less than the 5% default margin
    policy = _policy_with_counts([2, 5, 84], [8, 5, 16], no_draft=True, prior=0)
    assert policy.plan().draft_cap == 0 and policy.exit_layer == 8  # still watching layer 8
    policy = _policy_with_counts([2, 5, 84], [8, 5, 16], no_draft=True, prior=0, margin=0)
    assert (policy.plan().exit_layer, policy.plan().draft_cap) == (8, 1)


def test_the_prior_keeps_a_layer_seen_a_few_times_from_looking_certain():
    # layer 2 matched the one position it was scored at; layer 5 matched 97 of 100
    assert _policy_with_counts([1, 97, 0], [0, 3, 10], prior=0).exit_layer == 2  # alpha 1
    assert _policy_with_counts([1, 97, 0], [0, 3, 10]).exit_layer == 5  # prior 1: alpha(2) 0.5


def test_a_layer_drafts_only_with_enough_evidence():
    # layer 2 matched the two positions it was scored at; the others never match
    assert _policy_with_counts([2, 0, 0], [0, 5, 5], no_draft=True, prior=0).exit_layer == 2
    policy = _policy_with_counts([2, 0, 0], [0, 5, 5], no_draft=True, prior=0, min_evidence=3)
    assert policy.plan().draft_cap == 0
    policy = _policy_with_counts([3, 0, 0], [0, 5, 5], no_draft=True, prior=0, min_evidence=3)
    assert policy.plan().exit_layer == 2 and policy.plan().draft_cap > 0


def test_acceptance_in_runs_drafts_longer():
    # alpha(8) = 0.9; when accepted tokens are followed by accepted ones 98% of the time, a
    # longer draft pays more than the independent model says
    plain = _policy_with_counts([0, 0, 90], [10, 10, 10], prior=0)
    runs = _policy_with_counts([0, 0, 90], [10, 10, 10], prior=0, runs=True)
    assert plain.exit_layer == runs.exit_layer == 8
    runs.stats.after_match[2], runs.stats.continued[2] = 50.0, 49.0
    runs._choose()
    assert runs.draft_length > plain.draft_length


def test_unscored_rounds_count_the_exit_layers_own_drafts():
    model = tiny_model(seed=3, shallow=2)
    prompt = list(range(1, 30))
    expected = decode_tokens(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=60)
    policy = make_policy("del-fast", model.num_layers, shadow_budget=0.01, warmup=4)
    got = decode_tokens(model, prompt, policy, max_new_tokens=60, trace=True)
    assert got.token_ids == expected.token_ids
    for before, entry in zip(got.trace, got.trace[1:], strict=False):
        if entry["drafted"] and not entry["scored_layers"]:
            row = policy.candidates.index(entry["exit_layer"])
            if entry["accepted"] == entry["drafted"]:  # only matches: alpha cannot fall
                assert entry["alpha"][row] >= before["alpha"][row]
            else:  # a rejected draft: alpha cannot rise
                assert entry["alpha"][row] <= before["alpha"][row]
    assert any(e["drafted"] and not e["scored_layers"] for e in got.trace)


def test_the_warm_up_is_not_charged_to_the_shadow_budget():
    model = tiny_model(seed=3, shallow=2)
    policy = make_policy("del-fast", model.num_layers)
    got = decode_tokens(model, list(range(1, 30)), policy, max_new_tokens=1, trace=True)
    (warm_up,) = got.trace
    assert warm_up["scored_layers"] == model.num_layers - 1  # every candidate of a tiny model
    assert warm_up["shadow_ms"] > 0 and policy.credit > 0  # credit only grew by the round
