"""DEL's statistics (counts, alpha, tau, continuation), expected tokens and the TPL argmax,
against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from delspec.policies.cost_model import LayerCost
from delspec.policies.exit_statistics import (
    ExitStatistics,
    best_plan,
    expected_tokens,
    position_sums,
)

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
    assert [stats.threshold_at(row) for row in range(2)] == tau  # the scalar form


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


def test_one_row_in_scalar_arithmetic_agrees_with_the_arrays():
    """`add_to` and `rates` (one candidate, for a policy's per-round work) give what `add`,
    `alpha` and `continuation` give, rows without data and without pairs included."""
    rng = np.random.default_rng(0)
    scalar, arrays = ExitStatistics(4, omega=0.9), ExitStatistics(4, omega=0.9)
    for _ in range(5):
        row, sums = int(rng.integers(0, 3)), rng.uniform(0, 3, 6)  # row 3 is never updated
        scalar.add_to(row, sums.tolist())
        arrays.add(sums[:, None], [row])
    arrays.add(np.zeros((6, 1)), [3])  # decays nothing: row 3 stays empty
    assert scalar.sums == pytest.approx(arrays.sums)
    for prior in (0.0, 1.0, 3.0):
        alpha, continuation = arrays.alpha(prior), arrays.continuation(prior)
        for row in range(4):
            assert scalar.rates(row, prior) == pytest.approx((alpha[row], continuation[row]))
    assert scalar.rates(3) == (0.0, 0.0)


def test_several_rounds_added_to_a_row_at_once_decay_as_one_by_one():
    rng = np.random.default_rng(2)
    together, one_by_one = ExitStatistics(2, omega=0.9), ExitStatistics(2, omega=0.9)
    together.sums[:] = one_by_one.sums[:] = rng.uniform(0, 3, (6, 2))
    rounds = [rng.uniform(0, 2, 6).tolist() for _ in range(5)]
    for values in rounds:
        one_by_one.add_to(1, values)
    assert together.add_to(1, *rounds) == pytest.approx(one_by_one.sums[:, 1].tolist())
    assert together.sums == pytest.approx(one_by_one.sums)  # row 0 untouched in both


def test_position_sums_are_what_update_adds_for_one_row():
    rng = np.random.default_rng(1)
    scalar, arrays = ExitStatistics(3, omega=0.8), ExitStatistics(3, omega=0.8)
    for n in (1, 2, 5, 7):
        match, valid = rng.random(n) < 0.6, rng.random(n) < 0.8
        confidence, row = rng.random(n), n % 3
        arrays.update(match[None], confidence[None], valid[None], [row])
        scalar.add_to(row, position_sums(match.tolist(), confidence.tolist(), valid.tolist()))
        assert scalar.sums == pytest.approx(arrays.sums)
    every = position_sums([T, T, F], [0.5, 0.25, 1.0])  # all positions count by default
    assert every == [2.0, 1.0, 0.75, 1.0, 2.0, 1.0]


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
    assert stats.threshold_at(2) == 0.5


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
