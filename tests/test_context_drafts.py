"""Context drafts: the n-gram index, rounds that draft from the context (alone, or followed by
exit-layer drafts) staying lossless, and del-fast's choice of a round's source by cost."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import Scripted, profile, run
from tiny_models import tiny_model

from delspec.decoding.sequence import Decoding
from delspec.drafting.context_drafts import MAX_MATCH, NO_PROPOSAL, ContextIndex, ContextProposal
from delspec.drafting.exit_head import ExitHead
from delspec.errors import ConfigError
from delspec.policies import Plan, make_policy
from delspec.policies.cost_model import MeasuredCost
from delspec.policies.protocol import Round


def reference_proposal(tokens, limit, min_ngram, max_ngram, after=()):
    """What `ContextIndex.propose` must give, by scanning the whole sequence each time (with
    the tokens `after` it, whose own n-grams are not matched against)."""
    out: list[int] = []
    match_length = 0
    while len(out) < limit:
        seq = tokens + list(after) + out
        for n in range(max_ngram, min_ngram - 1, -1):
            if n > len(seq):
                continue
            suffix = seq[-n:]
            # latest occurrence whose next token is a real (not proposed) one
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                break
        else:
            break
        start = starts[-1] + n
        if not match_length:  # how far back the newest tokens equal those before `start`
            match_length = n
            while (
                match_length < MAX_MATCH
                and match_length < start
                and tokens[start - 1 - match_length] == seq[-1 - match_length]
            ):
                match_length += 1
        out.extend(tokens[start : min(len(tokens), start + limit - len(out))])
    return ContextProposal(out[:limit], match_length) if out else NO_PROPOSAL


def test_proposes_what_followed_the_latest_longest_match():
    index = ContextIndex([5, 1, 2, 7, 9, 1, 2, 8, 3, 1, 2], min_ngram=1, max_ngram=3)
    # "1 2" occurred twice before the end: the latest one was followed by 8, 3
    assert index.propose(2) == ContextProposal([8, 3], 2)
    index.extend([8])  # "1 2 8" now matches at order 3
    assert index.propose(3) == ContextProposal([3, 1, 2], 3)
    # a match reported as far back as it reaches, beyond the n-gram order, up to MAX_MATCH
    passage = list(range(100, 140))
    assert ContextIndex([*passage, 7, *passage[:5]], 1, 4).propose(2) == ContextProposal(
        passage[5:7], 5
    )
    assert ContextIndex([*passage, 7, *passage[:30]], 1, 4).propose(2) == ContextProposal(
        passage[30:32], MAX_MATCH
    )
    assert index.propose(0) == NO_PROPOSAL
    assert ContextIndex([1, 2, 3], min_ngram=2).propose(4) == NO_PROPOSAL  # no repeat


def test_a_repeating_pattern_is_proposed_past_the_end_of_the_sequence():
    index = ContextIndex([4, 6, 4, 6, 4], min_ngram=2, max_ngram=4)
    assert index.propose(7) == ContextProposal([6, 4, 6, 4, 6, 4, 6], 3)
    # after drafts 6, 4 (not committed): "4 6 4" matches, and the pattern goes on
    assert index.propose(3, [6, 4]) == ContextProposal([6, 4, 6], 3)
    assert index.propose(3, [9]) == NO_PROPOSAL


def test_incremental_index_matches_a_full_scan():
    rng = random.Random(0)
    for trial in range(40):
        tokens = [rng.randrange(4 if trial % 2 else 9) for _ in range(rng.randrange(1, 60))]
        low, high = rng.choice([(1, 1), (1, 4), (2, 4), (3, 3)])
        index = ContextIndex(tokens[:1], low, high)
        for i in range(1, len(tokens)):
            index.extend(tokens[i : i + 1])
            for limit in (1, 3, 8):
                expected = reference_proposal(tokens[: i + 1], limit, low, high)
                assert index.propose(limit) == expected, (tokens[: i + 1], limit, low, high)
                after = tokens[i + 1 : i + 1 + limit % 4]  # a round's drafts, not committed
                expected = reference_proposal(tokens[: i + 1], limit, low, high, after)
                assert index.propose(limit, after) == expected, (tokens[: i + 1], after)


def test_bad_orders_are_refused():
    with pytest.raises(ValueError, match="ngram"):
        ContextIndex([], 3, 2)
    with pytest.raises(ConfigError, match="ngram_min"):
        make_policy("lookup", 6, ngram_min=0)
    with pytest.raises(ConfigError, match="draft length"):
        make_policy("lookup", 6, draft_length=0)
    with pytest.raises(ConfigError, match="no option 'exit_layer'"):
        make_policy("lookup", 6, exit_layer=2)
    with pytest.raises(ConfigError, match="context_drafts needs cost"):
        make_policy("del", 6, context_drafts=True)


LAYERS = 6  # tiny_model's


@pytest.mark.parametrize("exit_layer", [0, 2, 6])
@pytest.mark.parametrize("weights", ["float", "int8", "blocks"])
def test_context_and_mixed_rounds_are_lossless(exit_layer, weights):
    """Context drafts accepted in full, in part, or not at all, alone or followed by exit-layer
    drafts (from an early layer and from the final one), on float64, int8 drafts and blocks."""
    paths = {"all": 0, "part": 0, "none": 0, "layers_after": 0}
    for seed in range(4):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1, blocks=weights == "blocks")
        prompt = list(range(seed, seed + 7))
        expected, _ = run(model, prompt, "ar", 40)
        head = ExitHead(model, int8=weights == "int8")
        for context in (1, 3, 5):
            policy = Scripted(LAYERS, expected.token_ids, context, lambda r: r % 4, exit_layer)
            got = Decoding(
                model, prompt, policy, max_new_tokens=40, exit_head=head, trace=True
            ).run()
            assert got.token_ids == expected.token_ids, (seed, context)
            for r in got.trace:
                k = r["from_context"]
                paths["all"] += k > 0 and r["accepted"] >= k
                paths["part"] += 0 < r["accepted"] < k
                paths["none"] += k > 0 and r["accepted"] == 0
                paths["layers_after"] += r["drafted"] > k > 0 and r["accepted"] > k
    assert paths["all"] and paths["part"] and paths["none"], paths
    assert bool(paths["layers_after"]) == bool(exit_layer), paths


@pytest.mark.parametrize("exit_layer", [2, 6])
@pytest.mark.parametrize("weights", ["float", "int8", "blocks"])
@pytest.mark.parametrize("switch_at", [None, 1])
def test_context_drafts_after_exit_layer_drafts_are_lossless(exit_layer, weights, switch_at):
    """Context tokens drafted after the exit layer's (after its last draft, or instead of its
    second), accepted in full, in part, or not at all, on float64, int8 drafts and blocks."""
    paths = {"all": 0, "part": 0, "none": 0}
    for seed in range(3):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1, blocks=weights == "blocks")
        prompt = list(range(seed, seed + 7))
        expected, _ = run(model, prompt, "ar", 40)
        head = ExitHead(model, int8=weights == "int8")
        for after in (1, 4):
            policy = Scripted(
                LAYERS,
                expected.token_ids,
                0,
                lambda r: r % 3,
                exit_layer,
                after=after,
                switch_at=switch_at,
            )
            got = Decoding(
                model, prompt, policy, max_new_tokens=40, exit_head=head, trace=True
            ).run()
            assert got.token_ids == expected.token_ids, (seed, after)
            for r in got.trace:
                k, layer_drafts = r["context_after"], r["drafted"] - r["context_after"]
                assert r["from_context"] == 0 and layer_drafts <= 3
                assert not k or switch_at is None or layer_drafts == switch_at
                beyond = r["accepted"] - layer_drafts  # of the context's tokens
                paths["all"] += k > 0 and beyond >= k
                paths["part"] += 0 < beyond < k
                paths["none"] += k > 0 and beyond <= 0
            stats = got.stats
            assert stats.mixed_rounds and stats.context_drafted >= stats.context_accepted > 0
    assert all(paths.values()), paths


def test_an_end_of_sequence_inside_a_context_draft_ends_the_output():
    model = tiny_model(seed=2, shallow=2, residual_scale=0.1)
    prompt = [3, 9, 27, 17]
    free, _ = run(model, prompt, "ar", 30)
    eos = next(t for i, t in enumerate(free.token_ids) if i >= 5 and t not in free.token_ids[:i])
    expected, _ = run(model, prompt, "ar", 30, (eos,))
    for exit_layer in (0, 2):
        # the whole reply, which ends at the EOS, as one context draft; nothing after it
        policy = Scripted(LAYERS, [*expected.token_ids, 1, 2], 40, lambda r: 40, exit_layer)
        got = Decoding(
            model, prompt, policy, max_new_tokens=30, eos_token_ids=(eos,), trace=True
        ).run()
        assert got.token_ids == expected.token_ids and got.finish_reason == "stop"
        assert len(got.trace) == 1 and got.trace[0]["drafted"] == len(expected.token_ids)


def test_the_index_holds_exactly_the_committed_tokens():
    """After every round (drafts accepted, rejected, or none) the index is the sequence's."""
    model = tiny_model(seed=1, shallow=2, residual_scale=0.1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    policy = make_policy("lookup", model.num_layers, ngram_min=1, draft_length=5)
    decoding = Decoding(model, prompt, policy, max_new_tokens=30)
    decoding.start()
    while not decoding.done:
        decoding.advance()
        index = decoding.engine.index
        assert index.tokens == decoding.tokens
        assert index.propose(6) == ContextIndex(index.tokens, 1, 4).propose(6)
    stats = decoding.finish().stats
    assert stats.drafted > stats.accepted > 0


def _fast_policy(layer_seconds, head_seconds, matched, mismatched, outcomes, **options):
    """A del-fast policy over exits 2, 5, 8 of a 10-layer model with a given profile, layer
    statistics, and context statistics: 12 rounds of proposals after 2-token matches that
    settled as `outcomes` (whether each token matched, up to the first miss)."""
    model = tiny_model(seed=0, num_layers=10)
    policy = make_policy("del-fast", 10, candidates=[2, 5, 8], shadow_budget=None, **options)
    policy.cost = MeasuredCost(profile(layer_seconds, head_seconds), 10)
    policy.start(ExitHead(model))
    policy.stats.matched = np.array(matched, dtype=np.float64)
    policy.stats.mismatched = np.array(mismatched, dtype=np.float64)
    policy._choose()
    for _ in range(12 if outcomes else 0):
        policy.context_score.count([(2, outcome) for outcome in outcomes])
    return policy


RIGHT_FOR_4 = [[True] * 4 + [False]]  # proposals right 4 tokens at a time
WRONG = [[False]]  # proposals whose first token misses
SOMETIMES = [[True, False], [False], [False], [False]]  # a first token right 1 time in 4
ALWAYS = [[True] * 6]  # proposals right all along


PROPOSAL = ContextProposal([11, 12, 13, 14, 15, 16], 2)
# per layer: k rows cost about what one does (a GPU, or a CPU's layers near the bandwidth floor)
FLAT = ([0.01] * 20, [0.05] * 20)
# verifying k rows costs k plain steps: no draft can pay
LINEAR = ([0.01 * k for k in range(1, 21)], [0.05 * k for k in range(1, 21)])


def test_a_context_draft_is_taken_when_it_pays():
    # layers agree poorly (no layer draft pays), proposals are right 4 tokens at a time
    policy = _fast_policy(*FLAT, [1, 1, 1], [30, 30, 30], RIGHT_FOR_4)
    assert policy.plan().draft_cap == 0  # without a proposal: a plain step
    plan = policy.plan(PROPOSAL)
    assert plan.exit_layer == 0 and plan.draft_cap == 0
    assert 3 <= len(plan.context_drafts) <= 6 and plan.context_drafts == tuple(
        PROPOSAL.tokens[: len(plan.context_drafts)]
    )


def test_no_context_draft_where_verification_costs_too_much_or_proposals_miss():
    expensive = _fast_policy(*LINEAR, [1, 1, 1], [30, 30, 30], RIGHT_FOR_4)
    assert expensive.plan(PROPOSAL) == Plan(0, 0)
    wrong = _fast_policy(*FLAT, [1, 1, 1], [30, 30, 30], WRONG)
    assert wrong.plan(PROPOSAL) == Plan(0, 0)


def test_a_layer_draft_that_beats_the_context_wins_and_both_can_extend():
    # layer 2 accepts 95% for a fifth of a step per draft: its drafts beat poor context drafts
    policy = _fast_policy(*FLAT, [95, 1, 1], [5, 30, 30], SOMETIMES)
    layer_plan = policy.plan()
    assert layer_plan.exit_layer == 2 and layer_plan.draft_cap > 0
    assert policy.plan(PROPOSAL) == layer_plan
    # a short proposal that is always right: it is drafted, then layer 2 drafts after it
    # (prior=1: the proposals' 12 rounds are not outweighed by CONTEXT_PRIOR's unseen misses)
    policy = _fast_policy(*FLAT, [95, 1, 1], [5, 30, 30], ALWAYS, prior=1.0)
    plan = policy.plan(ContextProposal([11], 2))
    assert plan.context_drafts == (11,) and plan.exit_layer == 2 and plan.draft_cap > 0


def test_a_context_draft_is_weighed_against_a_plain_step_where_the_sequence_is_now():
    """The plan was chosen where the statistics last changed (or where the previous sequence
    ended); a proposal is weighed at the position the round runs at. Each position adds to
    every layer's time, so a plain step after 1000 positions costs 5/3 of one at the start, and
    a one-token proposal right ~10% of the time pays there but not at the start."""
    model = tiny_model(seed=0, num_layers=10)
    proposal = ContextProposal([11], 2)

    def plan_at(chosen_at: int, now: int) -> Plan:
        policy = make_policy("del-fast", 10, candidates=[2, 5, 8], shadow_budget=None)
        timings = profile([0.01 * (1 + 0.1 * k) for k in range(20)], [0.05] * 20)
        timings.layer_slope = [1e-5] * 20
        policy.cost = MeasuredCost(timings, 10)
        policy.start(ExitHead(model))
        policy.stats.matched = np.array([1.0, 1.0, 1.0])
        policy.stats.mismatched = np.array([30.0, 30.0, 30.0])
        first = policy.context_score.match_class(proposal.match_length)  # its first-token row
        policy.context_score.stats.matched[first] = 10.5
        policy.context_score.stats.mismatched[first] = 86.5  # 10.5 / (97 + 3 unseen) = 10.5%
        policy.cost.at(chosen_at)
        policy._choose()
        policy.cost.at(now)
        return policy.plan(proposal)

    assert plan_at(1000, 1000).context_drafts == (11,)  # 2 rows cost 4% more than 1 there
    assert plan_at(0, 0) == Plan(0, 0)  # 6.7% more: a 10.5% chance does not beat the margin
    assert plan_at(1000, 0) == Plan(0, 0)  # chosen far on, weighed at the start
    assert plan_at(0, 1000).context_drafts == (11,)


def test_proposals_are_scored_against_the_committed_tokens():
    """Every round's proposal counts, drafted or not, once the tokens after it are committed:
    on a model that repeats itself, the context statistics fill from plain rounds alone."""
    model = tiny_model(seed=5)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    expected, _ = run(model, prompt, "ar", 40)
    policy = make_policy("del-fast", model.num_layers, candidates=[2])
    policy.cost = MeasuredCost(profile(*LINEAR), model.num_layers)  # nothing pays: plain steps
    got = Decoding(model, prompt, policy, max_new_tokens=40).run()
    assert got.token_ids == expected.token_ids and got.stats.drafted == 0
    stats = policy.context_score.stats
    assert float((stats.matched + stats.mismatched).sum()) > 0


def test_first_tokens_and_runs_are_counted_apart():
    """A proposal's first token and the tokens after an accepted one are estimated from their
    own counts: single-token matches that are rarely right at first but run on once right must
    not look right a third of the time."""
    policy = _fast_policy(*FLAT, [1, 1, 1], [30, 30, 30], [])
    score = policy.context_score
    for _ in range(10):  # first token right 1 time in 4; then 3 of 4 tokens after a right one
        score.count([(1, [True, True, True, True, False]), (1, [False]), (1, [False])])
        score.count([(1, [False])])
    first, then = score.acceptance(1)
    assert 0.2 < first < 0.3 and 0.7 < then < 0.8
    own, pool = np.split(score.stats.matched, score.SOURCES)  # the sequence's rows, the pool's
    firsts, runs = np.split(own, 2)  # first-token rows, then all-token rows
    assert not pool.any()
    assert firsts[0] > 0 and runs[0] > firsts[0] and not firsts[1:].any() and not runs[1:].any()


def test_longer_matches_are_classed_apart_and_start_from_shorter_ones():
    """Proposals are counted by how far their match reached; a class seen little is priced
    near the next shorter one's rates (not as if it had missed), and moves to its own."""
    policy = _fast_policy(*FLAT, [1, 1, 1], [30, 30, 30], [])
    score = policy.context_score
    assert [score.match_class(n) for n in (1, 2, 3, 4, 5, 6, 9, 10, 16)] == [
        0,
        1,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
    ]
    for _ in range(10):  # 1-token matches: first token right 1 time in 4
        score.count([(1, [True, False]), (1, [False]), (1, [False]), (1, [False])])
    short = score.acceptance(1)
    assert score.acceptance(2) == pytest.approx(short)  # nothing seen at 2: 1's rates
    assert score.acceptance(16) == pytest.approx(short)
    for _ in range(10):  # 12-token matches: right 6 tokens in a row every time
        score.count([(12, [True] * 6)])
    first, then = score.acceptance(12)
    assert first > 0.75 and then > 0.75  # 10 seen (decayed) against 3 pseudo-counts
    assert score.acceptance(5) == pytest.approx(short)  # the classes between: still 1's
    assert score.acceptance(1) == pytest.approx(short)


def test_context_tokens_follow_exit_layer_drafts_where_they_pay():
    """After layer 2's drafts (95% accepted, a fifth of a step each): a proposal that is always
    right is drafted, also instead of the rest of a planned draft; none after a context draft
    (not planned that way), nor from proposals whose first token misses."""
    policy = _fast_policy(*FLAT, [95, 1, 1], [5, 30, 30], ALWAYS, prior=1.0)
    plan = policy.plan()
    assert plan.exit_layer == 2 and plan.draft_cap >= 2 and not plan.context_drafts
    assert policy.follow(PROPOSAL, plan.draft_cap, True) == PROPOSAL.tokens
    assert policy.follow(PROPOSAL, 1, False) == PROPOSAL.tokens  # instead of drafting on
    assert policy.plan(ContextProposal([11], 2)).context_drafts == (11,)
    assert policy.follow(PROPOSAL, plan.draft_cap, True) == []
    wrong = _fast_policy(*FLAT, [95, 1, 1], [5, 30, 30], WRONG, prior=1.0)
    wrong_plan = wrong.plan()
    assert wrong_plan.draft_cap and wrong.follow(PROPOSAL, wrong_plan.draft_cap, True) == []


def test_a_proposal_after_exit_layer_drafts_is_scored_once_they_hold():
    """A proposal made after the exit layer's first drafts counts when those drafts were
    accepted (against the tokens committed after them), and not when one was rejected."""
    for accepted, counted in ((3, True), (1, False)):
        policy = _fast_policy(*FLAT, [1, 1, 1], [30, 30, 30], [])
        score = policy.context_score
        score.proposed(NO_PROPOSAL)
        score.followed(ContextProposal([5, 6], 2), 2)  # after layer drafts 3, 4
        drafted = [3, 4, 5, 6]
        tokens = [*drafted[:accepted], 9]
        record = Round(10, 2, drafted, [1.0] * 4, accepted, tokens, torch.tensor(tokens))
        record.context_after = 2
        score.committed(record)
        first_row = score.match_class(2)
        seen = score.stats.matched[first_row] + score.stats.mismatched[first_row]
        assert (seen > 0) == counted
        if counted:  # 5 matched, then 6 did not (9 was committed)
            every = score.CLASSES + first_row  # the class's all-token row
            assert score.stats.mismatched[first_row] == 0 < score.stats.matched[first_row]
            assert score.stats.matched[every] == score.stats.mismatched[every] > 0
