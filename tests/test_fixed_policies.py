"""The fixed-exit policies' rules (AR, static, FS, DV) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from delspec.policies import Plan, make_policy
from delspec.policies.protocol import Round


def finished(drafted: int, accepted: int) -> Round:
    """A round that drafted `drafted` tokens (confidence 0.9 each) and accepted `accepted`."""
    tokens = list(range(drafted))
    return Round(0, 3, tokens, [0.9] * drafted, accepted, [*tokens[:accepted], 0], torch.zeros(1))


def test_ar_and_static_plans():
    assert make_policy("ar", 6).plan() == Plan(0, 0)  # a plain step every round
    static = make_policy("static", 6, exit_layer=3, draft_length=4)
    static.observe(finished(4, 1))
    assert static.plan() == Plan(3, 4) and static.keep_drafting(0.0)


def test_fs_lengthens_after_a_full_accept_and_shortens_otherwise():
    policy = make_policy("fs", 6, exit_layer=3, draft_length=2, max_draft=4)
    policy.start(None)
    caps = []
    for drafted, accepted in [(2, 2), (3, 3), (4, 4), (4, 3), (3, 0), (2, 1), (1, 0), (0, 0)]:
        policy.observe(finished(drafted, accepted))
        caps.append(policy.plan().draft_cap)
    # +1 (3), +1 (4), capped at max_draft (4), -1 (3), -1 (2), -1 (1), floor 1, no draft: same
    assert caps == [3, 4, 4, 3, 2, 1, 1, 1]
    assert policy.plan().exit_layer == 3 and policy.keep_drafting(0.0)
    policy.start(None)  # every prompt starts again at draft_length
    assert policy.plan() == Plan(3, 2)


def test_dv_moves_its_threshold_toward_the_acceptance_target():
    # threshold 0.6, target 0.8, step 0.01, beta1 0.5, beta2 0.9 (the defaults)
    policy = make_policy("dv", 6, exit_layer=2)
    policy.start(None)
    assert policy.plan() == Plan(2, 18)  # drafts stop by confidence, or at max_draft
    assert policy.keep_drafting(0.6) and not policy.keep_drafting(0.59)
    record = finished(4, 2)
    policy.observe(record)
    # acceptance 2/4 = 0.5 starts the estimate; below the target: the threshold moves up,
    # 0.9 * 0.6 + 0.1 * (0.6 + 0.01)
    assert policy.rate == pytest.approx(0.5)
    assert policy.threshold == pytest.approx(0.601)
    assert record.extra["threshold"] == policy.threshold
    policy.observe(finished(2, 2))
    # cumulative 4/6; rate 0.5 * 0.5 + 0.5 * 4/6; threshold 0.9 * 0.601 + 0.1 * 0.611
    assert policy.rate == pytest.approx(0.5 * 0.5 + 0.5 * 4 / 6)
    assert policy.threshold == pytest.approx(0.602)
    policy.observe(finished(0, 0))  # a round without drafts changes nothing
    assert policy.threshold == pytest.approx(0.602)
    assert not policy.keep_drafting(0.6015)
    policy.start(None)  # state restarts for every prompt
    assert (policy.threshold, policy.rate, policy.drafted, policy.accepted) == (0.6, None, 0, 0)


def test_dv_above_its_target_drafts_more():
    policy = make_policy("dv", 6, exit_layer=2, threshold=0.5, target=0.5, step=0.1, beta2=0.5)
    policy.start(None)
    policy.observe(finished(4, 3))  # acceptance 0.75 >= 0.5: down by step, half-way
    assert policy.threshold == pytest.approx(0.5 * 0.5 + 0.5 * 0.4)
