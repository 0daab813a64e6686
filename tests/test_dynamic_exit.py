"""The paper's DEL (`DynamicExit`): shadow tokens, the valid context, the warm-up round, TPL choice,
dynamic draft exiting, and which DEL options run it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from delspec.decode_config import PAPER
from delspec.decoding.sequence import Decoding
from delspec.drafting.exit_head import ExitHead
from delspec.policies import make_policy
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.fast_dynamic_exit import FastDynamicExit
from delspec.policies.protocol import Round


def test_the_papers_options_run_the_papers_rule():
    for paper in (make_policy(PAPER, 30), make_policy("dele", 30), make_policy("del", 30, prior=0)):
        assert type(paper) is DynamicExit
    assert type(make_policy("del-fast", 30)) is FastDynamicExit
    for addition in (
        dict(cost="measured"),
        dict(no_draft=True),
        dict(shadow_budget=0.01),
        dict(runs=True),
        dict(min_evidence=1),
        dict(prior=1),
        dict(margin=0.1),
    ):
        assert type(make_policy("del", 30, **addition)) is FastDynamicExit, addition


@pytest.mark.parametrize("strategy", ["del", "dele"])
def test_tpl_choice_and_confidence_threshold_by_hand(strategy):
    policy = make_policy(strategy, 4, omega=1.0)
    policy.start(ExitHead(tiny_model(num_layers=4)))
    stats = policy.stats
    stats.matched = np.array([1.0, 3.0, 0.0])  # alpha = 0.5, 0.75, 0
    stats.mismatched = np.array([1.0, 1.0, 4.0])
    stats.confidence_matched = np.array([0.9, 2.4, 0.0])
    stats.confidence_mismatched = np.array([0.3, 0.2, 1.0])
    policy._choose()
    # TPL(l, d) = (1 + a + ... + a^d) / (d l + 4): layer 1, d = 1 gives 1.5 / 5 = 0.3; layer 2
    # at most 1.75 / 6 (d = 1); layer 3 (alpha 0) 1 / 4 (d = 0)
    assert (policy.exit_layer, policy.draft_length) == (1, 1)
    assert policy.tau_exit == pytest.approx((0.9 / 1 + 0.3 / 1) / 2)
    assert policy.alpha_trace == [0.5, 0.75, 0.0]
    if strategy == "del":  # drafts stop by confidence below tau, or at the cap of 18
        assert policy.plan().draft_cap == 18
        assert policy.keep_drafting(0.61) and not policy.keep_drafting(0.59)
    else:  # DELE drafts exactly d*
        assert policy.plan().draft_cap == 1 and policy.keep_drafting(0.0)


def _round(exit_layer, drafted, accepted, targets, hidden, warmup_rows=0):
    return Round(
        0, exit_layer, drafted, [0.9] * len(drafted), accepted, [], targets, hidden, warmup_rows
    )


class ScriptedHead(ExitHead):
    """Shadow tokens given per layer and position: logits one-hot on the scripted token."""

    def __init__(self, model, table):
        super().__init__(model)
        self.table = table

    def shadow(self, hidden, exit_layers):
        tokens = torch.tensor(
            [[self.table[e][p] for p in range(hidden.shape[1])] for e in exit_layers]
        )
        return torch.nn.functional.one_hot(tokens, 16).double() * 10


def test_valid_context_is_clipped_at_the_first_mismatch_of_the_exit_layer():
    model = tiny_model(num_layers=4)
    policy = make_policy("del", 4, omega=1.0)
    targets = [1, 2, 3, 4]
    # layer 2 (the exit layer used) mismatches first at position 1; layer 1 matches at 2 and 3
    table = {1: [1, 0, 3, 4], 2: [1, 5, 3, 4], 3: [1, 2, 3, 4]}
    policy.start(ScriptedHead(model, table))
    hidden = torch.zeros(4, 4, 32)
    policy.observe(_round(2, [1, 5, 3], 1, torch.tensor(targets), hidden))
    # valid context = positions 0..1: layer1 1/2, layer2 1/2, layer3 2/2
    assert policy.stats.matched.tolist() == [1.0, 1.0, 2.0]
    assert policy.stats.mismatched.tolist() == [1.0, 1.0, 0.0]
    conf = math.exp(10) / (math.exp(10) + 15)
    assert policy.stats.confidence_matched.tolist() == pytest.approx([conf, conf, 2 * conf])


def test_warmup_rows_are_never_clipped():
    model = tiny_model(num_layers=3)
    policy = make_policy("del", 3, omega=1.0)
    table = {1: [0, 0, 0, 1, 9], 2: [5, 6, 7, 8, 9]}
    policy.start(ScriptedHead(model, table))
    assert policy.plan().exit_layer == 1 and policy.plan().draft_cap == 1  # round 0
    record = _round(1, [1], 0, torch.tensor([5, 6, 7, 8, 9]), torch.zeros(3, 5, 32), warmup_rows=3)
    policy.observe(record)
    # layer 1 mismatches at every warm-up position and at round position 0 -> u = 0:
    # valid = 3 warm-up positions + position 0 (position 1 dropped)
    assert policy.stats.matched.tolist() == [0.0, 4.0]
    assert policy.stats.mismatched.tolist() == [4.0, 0.0]
    assert policy.plan().exit_layer == 2  # alpha(2) = 1 wins the TPL search
    assert policy.plan().draft_cap == 18


def test_round_zero_uses_the_prompt_window_and_state_resets_per_prompt():
    model = tiny_model(seed=2, shallow=2)
    policy = make_policy("del", model.num_layers, warmup=32)
    seen = []
    observe = policy.observe
    policy.observe = lambda r: (
        seen.append((r.warmup_rows, r.hidden.shape[1], len(r.drafted))),
        observe(r),
    )[-1]
    prompt = list(range(1, 41))
    first = Decoding(model, prompt, policy, max_new_tokens=12).run()
    assert seen[0] == (32, 32 + 2, 1)  # 32 warm-up positions + input + one draft
    assert all(c == 0 for c, _, _ in seen[1:])
    stats_after_first = policy.stats.matched.copy()
    seen.clear()
    second = Decoding(model, prompt, policy, max_new_tokens=12).run()
    assert second.token_ids == first.token_ids
    assert seen[0][0] == 32
    assert np.array_equal(policy.stats.matched, stats_after_first)  # nothing carried over


@pytest.mark.parametrize("strategy", ["del", "dele"])
def test_only_del_stops_drafts_by_confidence(strategy):
    """DEL ends a draft at a token whose confidence is below tau; DELE drafts its cap."""
    model = tiny_model(seed=2, shallow=2)
    policy = make_policy(strategy, model.num_layers, cost="measured")
    got = Decoding(model, list(range(1, 30)), policy, max_new_tokens=60, trace=True).run()
    rounds = got.trace[1:-1]  # drafting rounds that neither start nor end the reply
    caps = [r["next_draft_cap"] for r in got.trace[:-2]]
    stopped = [r["drafted"] < cap for r, cap in zip(rounds, caps, strict=True)]
    assert all(r["drafted"] <= cap for r, cap in zip(rounds, caps, strict=True))
    assert any(stopped) if strategy == "del" else not any(stopped)


def test_shadow_tokens_equal_a_full_pass_with_that_exit_layer():
    """The cached per-layer states of a round decode exactly like a forward pass exiting there."""
    model = tiny_model(seed=5, shallow=2)
    policy = make_policy("del", model.num_layers)
    records = []
    observe = policy.observe
    policy.observe = lambda r: (records.append(r), observe(r))[-1]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = Decoding(model, prompt, policy, max_new_tokens=20).run()
    sequence = prompt + out.token_ids
    record = next(r for r in records[1:] if len(r.drafted) >= 2)
    valid = record.accepted + 1  # positions whose inputs are all committed
    inputs = torch.tensor(sequence[: record.position + valid])
    model.setup_cache(64)
    h = model.embed(inputs)
    for layer in range(model.num_layers):
        h = model.run_layers(h, 0, layer, layer + 1)
        got = record.hidden[layer, :valid]
        expected = h[record.position : record.position + valid]
        assert (got - expected).abs().max() < 1e-10, layer
        assert torch.equal(model.head(got).argmax(-1), model.head(expected).argmax(-1))
