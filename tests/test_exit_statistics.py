"""DEL's statistics and policy decisions against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

from delspec.costs import LayerCost
from delspec.engine import ExitHead, Round
from delspec.exit_statistics import ExitStatistics, best_plan, expected_tokens
from delspec.generate import decode_tokens
from delspec.policies import make_policy

T, F = True, False


def test_decayed_counts_alpha_and_tau_by_hand():
    stats = ExitStatistics(2, omega=0.5)
    match = torch.tensor([[T, F, T], [T, T, T]])
    confidence = torch.tensor([[0.9, 0.2, 0.7], [0.8, 0.6, 0.4]])
    stats.update(match, confidence, torch.tensor([T, T, F]))  # position 2 outside the context
    assert stats.matched.tolist() == [1.0, 2.0]
    assert stats.mismatched.tolist() == [1.0, 0.0]
    assert stats.confidence_matched.tolist() == pytest.approx([0.9, 1.4])
    assert stats.confidence_mismatched.tolist() == pytest.approx([0.2, 0.0])
    stats.update(torch.tensor([[F], [T]]), torch.tensor([[0.5], [1.0]]), torch.tensor([T]))
    # A = 0.5 * A + m, B = 0.5 * B + (n - m), S = 0.5 * S + sum
    assert stats.matched.tolist() == pytest.approx([0.5, 2.0])
    assert stats.mismatched.tolist() == pytest.approx([1.5, 0.0])
    assert stats.alpha().tolist() == pytest.approx([0.25, 1.0])
    tau = stats.threshold().tolist()
    assert tau[0] == pytest.approx(((0.45 / 0.5) + (0.6 / 1.5)) / 2)
    # never mismatched: mismatched mean taken as 0 (the reference code gives NaN)
    assert tau[1] == pytest.approx(((0.5 * 1.4 + 1.0) / 2.0) / 2)


def test_continuation_counts_pairs_of_valid_neighbours():
    stats = ExitStatistics(2, omega=0.5)
    # Row 0: pairs (T,T) (T,F) (F,T) (T,T): 3 after a match, 2 of them continued.
    # Row 1: the last position is outside the context, so only (T,T) (T,F) (F,F) count.
    match = torch.tensor([[T, T, F, T, T], [T, T, F, F, T]])
    valid = torch.tensor([T, T, T, T, T])
    stats.update(match[:1], torch.ones(1, 5), valid, torch.tensor([0]))
    stats.update(match[1:], torch.ones(1, 5), torch.tensor([T, T, T, T, F]), torch.tensor([1]))
    assert stats.after_match.tolist() == [3.0, 2.0]
    assert stats.continued.tolist() == [2.0, 1.0]
    assert stats.continuation().tolist() == pytest.approx([2 / 3, 1 / 2])
    # The prior pulls towards alpha: (2 + alpha) / (3 + 1) with alpha = 4 / (5 + 1).
    assert stats.continuation(1.0)[0].item() == pytest.approx((2 + 4 / 6) / 4)
    fresh = ExitStatistics(1)
    fresh.update(torch.tensor([[T]]), torch.ones(1, 1), torch.tensor([T]))  # no pair yet
    assert fresh.continuation(1.0).tolist() == fresh.alpha(1.0).tolist() == [0.5]


def test_expected_tokens_with_runs():
    alpha = torch.tensor([0.5, 0.8], dtype=torch.float64)
    lengths = torch.arange(0, 4)
    independent = expected_tokens(alpha, lengths)
    assert expected_tokens(alpha, lengths, alpha).tolist() == independent.tolist()
    runs = expected_tokens(alpha, lengths, torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert runs[1].tolist() == pytest.approx([1, 1.8, 2.6, 3.4])  # 1 + 0.8 * (1 + 1 + ...)


def test_layer_without_data_is_finite():
    stats = ExitStatistics(3)
    assert stats.alpha().tolist() == [0.0, 0.0, 0.0]
    assert stats.threshold().tolist() == [0.5, 0.5, 0.5]


def test_expected_tokens_and_tpl_argmax():
    alpha = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    lengths = torch.arange(0, 4)
    tokens = expected_tokens(alpha, lengths)
    assert tokens[0].tolist() == [1, 1, 1, 1]  # alpha = 0: only the bonus token
    assert tokens[1].tolist() == pytest.approx([1, 1.5, 1.75, 1.875])
    assert tokens[2].tolist() == [1, 2, 3, 4]  # alpha = 1 is safe (no 1 - alpha division)
    cost = LayerCost(8).grid(torch.tensor([1, 2, 3]), lengths)
    assert cost[1].tolist() == [8, 10, 12, 14]  # d * l + L
    value = tokens / cost
    row, col = best_plan(value)
    # layer 3 with alpha 1 drafting 3: 4 / (9 + 8) beats every other cell
    assert (row, col) == (2, 3)
    assert value[row, col] == pytest.approx(4 / 17)


def test_ties_take_the_first_maximum():
    assert best_plan(torch.tensor([[1.0, 2.0], [2.0, 0.0]])) == (0, 1)


def _round(exit_layer, drafted, accepted, targets, hidden, context=0):
    return Round(
        0, exit_layer, drafted, [0.9] * len(drafted), accepted, [], targets, hidden, context
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


def test_warmup_context_is_never_clipped():
    model = tiny_model(num_layers=3)
    policy = make_policy("del", 3, omega=1.0)
    table = {1: [0, 0, 0, 1, 9], 2: [5, 6, 7, 8, 9]}
    policy.start(ScriptedHead(model, table))
    assert policy.plan().exit_layer == 1 and policy.plan().draft_cap == 1  # round 0
    record = _round(1, [1], 0, torch.tensor([5, 6, 7, 8, 9]), torch.zeros(3, 5, 32), context=3)
    policy.observe(record)
    # layer 1 mismatches at every context position and at round position 0 -> u = 0:
    # valid = 3 context positions + position 0 (position 1 dropped)
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
        seen.append((r.context, r.hidden.shape[1], len(r.drafted))),
        observe(r),
    )[-1]
    prompt = list(range(1, 41))
    first = decode_tokens(model, prompt, policy, max_new_tokens=12)
    assert seen[0] == (32, 32 + 2, 1)  # 32 context positions + input + one draft
    assert all(c == 0 for c, _, _ in seen[1:])
    stats_after_first = policy.stats.matched.clone()
    seen.clear()
    second = decode_tokens(model, prompt, policy, max_new_tokens=12)
    assert second.token_ids == first.token_ids
    assert seen[0][0] == 32
    assert torch.equal(policy.stats.matched, stats_after_first)  # nothing carried over


@pytest.mark.parametrize("strategy", ["del", "dele"])
def test_only_del_stops_drafts_by_confidence(strategy):
    """DEL ends a draft at a token whose confidence is below tau; DELE drafts its cap."""
    model = tiny_model(seed=2, shallow=2)
    policy = make_policy(strategy, model.num_layers, cost="measured")
    got = decode_tokens(model, list(range(1, 30)), policy, max_new_tokens=60, trace=True)
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
    out = decode_tokens(model, prompt, policy, max_new_tokens=20)
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


@pytest.mark.parametrize(
    "strategy,options,message",
    [
        ("static", dict(exit_layer=0), "exit layer must be in 1..6"),
        ("static", dict(exit_layer=7), "exit layer must be in 1..6"),
        ("static", dict(exit_layer=2, draft_length=0), "draft length must be >= 1"),
        ("del", dict(candidates=[2, 9]), "exit layer must be in 1..6"),
        ("del", dict(omega=0.0), "omega must be in"),
        ("del", dict(min_evidence=-1), "min_evidence must be >= 0"),
        ("dv", dict(exit_layer=2, threshold=1.5), "threshold must be in"),
        ("nope", dict(), "unknown strategy 'nope'"),
        ("static", dict(bogus=1), "strategy 'static' has no option 'bogus'"),
    ],
)
def test_bad_strategy_parameters(strategy, options, message):
    from delspec.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_policy(strategy, 6, **options)
