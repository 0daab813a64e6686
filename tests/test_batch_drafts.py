"""`BatchDrafts`: which context draft tokens a batched step verifies, on given step costs and
acceptance (no model needed)."""

from __future__ import annotations

import pytest

from delspec.drafting.batch_drafts import BatchDrafts
from delspec.drafting.context_drafts import POOL, SEQUENCE

# a CPU-like batched step: rows nearly free up to 8, then about linear
CHEAP_ROWS = {1: 1.0, 2: 1.02, 4: 1.06, 8: 1.2, 16: 2.2, 32: 4.4}


def test_step_seconds_interpolate_and_extend_at_the_last_cost_per_row():
    drafts = BatchDrafts(CHEAP_ROWS)
    assert drafts.step_seconds(3) == pytest.approx(1.04)
    assert drafts.step_seconds(40) == pytest.approx(4.4 + 8 * 2.2 / 16)
    assert BatchDrafts({1: 2.0}).step_seconds(3) == pytest.approx(6.0)


def test_drafts_fill_the_cheap_rows_likeliest_first_and_stop_where_rows_cost_more():
    drafts = BatchDrafts(CHEAP_ROWS)  # prior: half of the drafts accepted
    proposals = [[1, 2, 3, 4, 5, 6], [7, 8], []]
    # 3 input rows (3 tokens in 1.04 s); then, likeliest first, draft tokens expected to add
    # 0.5 (sequence 0), 0.5 (1), 0.25 (0), 0.25 (1): 4.5 tokens in 7 rows, 1.165 s. The next,
    # 0.125 more in an eighth row (1.2 s), would lower the tokens per second.
    assert drafts.choose(proposals) == [[1, 2], [7, 8], []]


def test_rows_that_cost_a_step_each_draft_nothing():
    assert BatchDrafts({1: 1.0, 2: 2.0, 4: 4.0}).choose([[1, 2, 3], [4]]) == [[], []]
    assert BatchDrafts({}).choose([[1, 2, 3]]) == [[]]  # nothing measured: no drafts


def test_acceptance_is_learned_per_draft_index():
    drafts = BatchDrafts({1: 1.0, 2: 1.45, 4: 2.35, 8: 4.15})  # each row 45% of a step
    assert drafts.choose([[1, 2, 3]]) == [[1]]  # 0.5 expected for 0.45 more: one only
    for _ in range(20):  # every draft accepted: the chances rise towards 1
        drafts.observe([[1, 2, 3]], [3])
    assert drafts.choose([[1, 2, 3]]) == [[1, 2, 3]]
    second = drafts.seen[SEQUENCE, 1]
    for _ in range(40):  # now the first is always rejected
        drafts.observe([[1, 2, 3]], [0])
    assert drafts.choose([[1, 2, 3]]) == [[]]
    # a rejected first token decides nothing about the second: its counts only decay
    assert drafts.seen[SEQUENCE, 1] == pytest.approx(second * 0.95**40)


def test_pool_drafts_are_learned_apart_from_the_sequences_own():
    drafts = BatchDrafts({1: 1.0, 2: 1.45, 4: 2.35, 8: 4.15})
    for _ in range(20):  # the sequence's own drafts accepted, the pool's rejected
        drafts.observe([[1, 2, 3], [4, 5, 6]], [3, 0], [SEQUENCE, POOL])
    proposals = [[1, 2, 3], [4, 5, 6]]
    assert drafts.choose(proposals, [SEQUENCE, POOL]) == [[1, 2, 3], []]
    assert drafts.choose(proposals, [POOL, SEQUENCE]) == [[], [4, 5, 6]]
