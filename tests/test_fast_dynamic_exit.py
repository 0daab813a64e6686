"""del-fast's additions to DEL (`FastDynamicExit`): measured costs, no-draft rounds, the margin,
prior and min_evidence rules, acceptance in runs, draft vocabulary levels, the shadow budget."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import profile
from tiny_models import tiny_model

from delspec.decoding.sequence import Decoding
from delspec.drafting.context_drafts import NO_PROPOSAL, ContextProposal
from delspec.drafting.draft_head import DraftHead
from delspec.drafting.exit_head import ExitHead
from delspec.policies import PolicyInputs, fast_dynamic_exit, fast_state, make_policy
from delspec.policies.cost_model import MeasuredCost
from delspec.policies.fast_dynamic_exit import HELD_BATCH, FastDynamicExit
from delspec.policies.protocol import Round

LAYERS = 10
EXITS = torch.tensor([2, 5, 8])


def test_no_draft_rounds_with_a_profile_where_drafting_cannot_pay(tmp_path, monkeypatch):
    model = tiny_model(seed=0, shallow=2)
    policy = make_policy("del", model.num_layers, cost="measured", no_draft=True)
    # verifying k tokens costs k plain steps: even always-accepted drafts cannot pay
    slow = profile([1.0 * k for k in range(1, 21)], [0.1 * k for k in range(1, 21)], 0.5)
    policy.cost = MeasuredCost(slow, model.num_layers)
    prompt = list(range(3, 20))
    expected = Decoding(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=30).run()
    got = Decoding(model, prompt, policy, max_new_tokens=30, trace=True).run()
    assert got.token_ids == expected.token_ids
    plain = [r for r in got.trace if r["exit_layer"] == 0]
    assert len(plain) >= 25  # after the warm-up round, every round is a plain step
    # statistics keep updating from plain steps: alpha changes between plain rounds
    assert plain[0]["alpha"] != plain[-1]["alpha"]


def test_shadow_budget_bounds_policy_work_and_stays_lossless():
    model = tiny_model(seed=3, shallow=2)
    prompt = list(range(1, 30))
    expected = Decoding(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=60).run()
    policy = make_policy("del", model.num_layers, shadow_budget=0.05, no_draft=True)
    got = Decoding(model, prompt, policy, max_new_tokens=60, trace=True).run()
    assert got.token_ids == expected.token_ids
    scored = [r for r in got.trace[1:] if r["scored_layers"]]
    assert len(scored) < len(got.trace) - 1  # some rounds skip scoring entirely


def _policy_with_counts(matched, mismatched, **options):
    """A measured-cost DEL over exits 2, 5, 8 of a 10-layer model with given decayed counts."""
    model = tiny_model(seed=0, num_layers=LAYERS)
    policy = make_policy("del", LAYERS, candidates=EXITS.tolist(), cost="measured", **options)
    policy.cost = MeasuredCost(profile([1.0] * 20, [0.5] * 20), LAYERS)  # GPU-like
    policy.start(ExitHead(model))
    policy.stats.matched = np.array(matched, dtype=np.float64)
    policy.stats.mismatched = np.array(mismatched, dtype=np.float64)
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


def test_the_cost_model_picks_a_larger_draft_vocabulary_where_it_accepts_more():
    model = tiny_model(seed=0, num_layers=LAYERS)
    head = DraftHead(model, vocab=[torch.arange(16), torch.arange(32), None])
    policy = make_policy("del", LAYERS, candidates=EXITS.tolist(), cost="measured", prior=0)
    # per draft token: 16 rows 0.001 s, 32 rows 0.1 s, the full head 3 s
    drafts = [0.001, 0.1, 3.0]
    policy.cost = MeasuredCost(profile([1.0] * 20, [0.5] * 20, drafts), LAYERS)
    policy.start(head)
    assert len(policy.stats.matched) == 9  # (vocabulary, layer) rows, vocabulary-major
    policy.stats.matched = np.array([2.0, 5.0, 60.0] * 3)
    policy.stats.mismatched = np.array([8.0, 5.0, 40.0] * 3)
    policy._choose()
    assert policy.plan().level == 0  # equal acceptance everywhere: the cheapest vocabulary
    # layer 8 drafts 95% right from the 32 tokens (and from all), 60% from the 16
    policy.stats.matched[[5, 8]], policy.stats.mismatched[[5, 8]] = 95.0, 5.0
    policy._choose()
    larger = policy.plan()
    assert (larger.exit_layer, larger.level) == (8, 1) and larger.draft_cap > 1
    # the paper's layer cost cannot see what a larger vocabulary costs: it keeps the smallest
    paper = make_policy("del", LAYERS, candidates=EXITS.tolist())
    paper.start(head)
    assert paper.levels == 1 and len(paper.stats.matched) == 3 and paper.plan().level == 0


def test_shadow_tokens_credit_larger_vocabularies_with_targets_the_smallest_lacks():
    model = tiny_model(seed=2, num_layers=4)
    small = torch.arange(8)  # 8 of the 64 tokens
    head = DraftHead(model, vocab=[small, None], context_vocab=False)
    policy = make_policy("del", 4, cost="measured", omega=1.0, prior=0)
    policy.cost = MeasuredCost(profile([1.0] * 20, [0.5] * 20, [0.001, 0.002]), 4)
    policy.start(head)
    hidden = torch.randn(4, 40, 32, dtype=model.dtype, generator=torch.Generator().manual_seed(0))
    layers = policy.candidates  # 1..4: the final layer drafts cheaply with a pruned head
    logits = DraftHead(model).shadow(hidden[[e - 1 for e in layers]], layers)
    best_small = logits[..., :8].max(-1)
    # targets: layer 1's choice among the 8 tokens, or a token outside them (layer 2's choice,
    # or another)
    full_choice = logits[1].argmax(-1)
    targets = torch.where(torch.arange(40) % 3 == 0, best_small.indices[0], full_choice)
    targets[2::6] = 40 + torch.arange(len(targets[2::6])) % 20
    record = Round(0, 0, [], [], 0, [], targets, hidden)  # a plain round: all positions valid
    policy.observe(record)
    target_logit = logits.gather(-1, targets.expand(len(layers), -1)[..., None])[..., 0]
    inside = targets < 8
    small_match = best_small.indices == targets
    reach = ~inside & (target_logit >= best_small.values)
    assert small_match.any() and reach.any() and (~inside & ~reach).any()
    matched = policy.stats.matched
    assert matched[: len(layers)].tolist() == small_match.sum(1).double().tolist()
    assert matched[len(layers) :].tolist() == (small_match | reach).sum(1).double().tolist()
    assert (matched + policy.stats.mismatched).tolist() == [40.0] * 2 * len(layers)


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
    expected = Decoding(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=60).run()
    # exit-layer drafts only (context drafts have their own statistics)
    policy = make_policy(
        "del-fast", model.num_layers, shadow_budget=0.01, warmup=4, context_drafts=False
    )
    got = Decoding(model, prompt, policy, max_new_tokens=60, trace=True).run()
    assert got.token_ids == expected.token_ids
    for before, entry in zip(got.trace, got.trace[1:], strict=False):
        if entry["drafted"] and not entry["scored_layers"]:
            row = policy.candidates.index(entry["exit_layer"])
            if entry["accepted"] == entry["drafted"]:  # only matches: alpha cannot fall
                assert entry["alpha"][row] >= before["alpha"][row]
            else:  # a rejected draft: alpha cannot rise beyond this round's own a / (a + 1)
                rate = entry["accepted"] / (entry["accepted"] + 1)
                assert entry["alpha"][row] <= max(before["alpha"][row], rate) + 1e-4
    assert any(e["drafted"] and not e["scored_layers"] for e in got.trace)


def test_the_warm_up_is_not_charged_to_the_shadow_budget():
    model = tiny_model(seed=3, shallow=2)
    policy = make_policy("del-fast", model.num_layers)
    got = Decoding(model, list(range(1, 30)), policy, max_new_tokens=1, trace=True).run()
    (warm_up,) = got.trace
    assert warm_up["scored_layers"] == model.num_layers - 1  # every candidate of a tiny model
    assert warm_up["shadow_ms"] > 0 and policy.credit > 0  # credit only grew by the round


def test_a_scored_round_takes_only_the_positions_its_credit_affords():
    model = tiny_model(seed=3, num_layers=LAYERS)
    policy = make_policy("del", LAYERS, shadow_budget=0.01, no_draft=True)
    policy.start(ExitHead(model))
    policy.in_warmup, policy.exit_layer = False, 5
    policy.row_cost = 0.001  # 1 ms per (layer, position)
    hidden = torch.zeros(LAYERS, 12, model.config.hidden_size, dtype=model.dtype)
    drafts = list(range(11))
    record = Round(0, 5, drafts, [0.9] * 11, 11, [*drafts, 0], torch.zeros(12).long(), hidden)
    for credit, rows, positions in ((0.008, 4, 2), (0.024, 4, 6), (0.06, 5, 12), (1.0, 9, 12)):
        policy.credit = credit
        chosen, scored = policy._scope(record)
        assert (len(chosen), len(scored)) == (rows, positions)
        assert {4, 5, 6} <= {policy.candidates[r] for r in chosen.tolist()}  # E and neighbours
        assert scored.tolist() == list(range(positions))  # the first of the valid positions
    policy.credit = 0.0079
    assert not policy._will_score_next()  # not even 4 layers at 2 positions


def test_a_draft_cap_set_by_the_user_bounds_the_optimum():
    # alpha(8) = 0.95 on a GPU-like profile: d* = 2 caps the draft, unless draft_cap is lower
    policy = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0)
    assert (policy.draft_length, policy.plan().draft_cap) == (2, 2)
    capped = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0, draft_cap=1)
    assert (capped.draft_length, capped.plan().draft_cap) == (2, 1)


def test_a_final_layer_draft_is_the_target_exactly_where_its_vocabulary_holds_it():
    """At the final layer a level's draft is the full head's greedy token restricted to its
    vocabulary: the target (the full head's) exactly when the level holds it."""
    model = tiny_model(seed=4, num_layers=4)
    levels = [torch.arange(8), torch.arange(24), None]
    head = DraftHead(model, vocab=levels, context_vocab=False)
    assert head.final_layer_is_full_head
    h = torch.randn(64, 32, dtype=model.dtype, generator=torch.Generator().manual_seed(1))
    targets = model.head(h).argmax(-1).tolist()
    held = head.held(targets)
    assert [sum(level) for level in held][-1] == 64 and 0 < sum(held[0]) < 64  # both kinds
    for level, vocab in enumerate(levels):
        column = head(h, 4, level).argmax(-1)
        drafts = (column if vocab is None else vocab[column]).tolist()
        assert [d == t for d, t in zip(drafts, targets, strict=True)] == held[level]
    assert head.covered(torch.tensor(targets)).tolist() == held
    int8 = DraftHead(
        tiny_model(seed=4, num_layers=4, dtype=torch.float32), vocab=levels[0], int8=True
    )
    assert not int8.final_layer_is_full_head  # int8 drafts differ from the full head's


def _final_layer_policy(context_vocab: bool = False, omega: float = 1.0):
    """A measured-cost DEL on a 4-layer model past its warm-up, drafting vocabularies of 8
    tokens and the full one (and the sequence's tokens, with `context_vocab`, after a prompt
    of token 0), statistics decayed by `omega` and without a prior."""
    model = tiny_model(seed=2, num_layers=4)
    head = DraftHead(model, vocab=[torch.arange(8), None], context_vocab=context_vocab)
    policy = make_policy("del", 4, cost="measured", omega=omega, prior=0, shadow_budget=0.01)
    policy.cost = MeasuredCost(profile([1.0] * 20, [0.5] * 20, [0.001, 0.002]), 4)
    policy.start(head.for_prompt([0]))
    policy.in_warmup = False
    return policy


def test_every_round_updates_the_final_layer_from_its_verification():
    """The final layer drafts as the full head restricted to a vocabulary: each round's own
    targets say what it would have drafted at every position whose inputs were accepted, so its
    statistics grow without shadow tokens, whatever the shadow budget allows."""
    policy = _final_layer_policy()
    final = policy.candidates.index(4)
    targets = [3, 20, 5]  # in the small level, outside it, in it
    rows = [final, len(policy.candidates) + final]  # the final layer at each level

    def context_round(accepted: int) -> None:
        """Two context draft tokens, `accepted` of them accepted, no states: unscored (its
        updates applied at once, not held back for later rounds')."""
        record = Round(
            0, 0, targets[:2], [], accepted, targets[: accepted + 1], torch.tensor(targets)
        )
        record.from_context = 2
        policy.credit = 0.0  # nothing for shadow tokens
        policy.observe(record)
        policy.apply_held()

    context_round(0)  # one valid position: 3
    assert policy.stats.matched[rows].tolist() == [1.0, 1.0]
    assert policy.stats.mismatched[rows].tolist() == [0.0, 0.0]
    context_round(2)  # three: 3, 20, 5
    assert policy.stats.matched[rows].tolist() == [3.0, 4.0]
    assert policy.stats.mismatched[rows].tolist() == [1.0, 0.0]
    others = [r for r in range(2 * len(policy.candidates)) if r not in rows]
    assert (policy.stats.matched + policy.stats.mismatched)[others].sum() == 0


def test_a_count_chooses_the_plan_again_only_when_an_alpha_moved():
    policy = _final_layer_policy()
    choices = []
    choose = policy._choose
    policy._choose = lambda: choices.append(len(choices)) or choose()

    def plain_round(target: int) -> None:
        """A plain round, its updates applied at once (not held back for later rounds')."""
        policy.observe(Round(0, 0, [], [], 0, [target], torch.tensor([target])))
        policy.apply_held()

    plain_round(3)  # alpha 0 -> 1 at both levels: chosen again
    final = [policy.chosen_alpha[row] for row in policy.final_rows]
    assert len(choices) == 1 and final == [1.0, 1.0]
    for _ in range(5):
        plain_round(3)  # alpha stays 1
    assert len(choices) == 1
    plain_round(20)  # outside the small level: its alpha falls to 6/7
    final = [policy.chosen_alpha[row] for row in policy.final_rows]
    assert len(choices) == 2 and final == pytest.approx([6 / 7, 1.0])


def test_rounds_held_back_reach_the_statistics_of_rounds_applied_one_by_one(monkeypatch, tmp_path):
    """The updates of a round without exit-layer drafts (a plain step, or context drafts
    alone) wait for `HELD_BATCH` of them (or `apply_held`, or a round that is not held back);
    applied, they leave every statistic where applying each round at once would have: the
    final layer's counts (which target each level held then: the sequence's tokens join the
    draft vocabularies as it runs), the context proposals' scores, the realized plain steps,
    the cost check's samples."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 12, 80).tolist()  # some in the small level (0..7), some not
    proposals = {i: ContextProposal(tokens[i + 1 : i + 3], 2) for i in range(0, 40, 3)}

    def run(batch: int, rounds: int) -> FastDynamicExit:
        monkeypatch.setattr(fast_dynamic_exit, "HELD_BATCH", batch)
        policy = _final_layer_policy(context_vocab=True, omega=0.9)
        policy.cost.profile.path = str(tmp_path / "none.json")  # as if measured: checked
        at = 0  # the sequence's position
        for i in range(rounds):
            policy.context_score.proposed(proposals.get(i, NO_PROPOSAL))
            if i % 4 == 3:  # two context draft tokens: both right, or the second wrong
                drafted = [tokens[at], tokens[at + 1] if i % 8 == 3 else 99]
                accepted = 2 if i % 8 == 3 else 1
                record = Round(
                    at, 0, drafted, [], accepted, tokens[at : at + accepted + 1],
                    torch.tensor(tokens[at : at + 3]),
                )  # fmt: skip
                record.from_context = 2
            else:
                record = Round(at, 0, [], [], 0, [tokens[at]], torch.tensor([tokens[at]]))
            record.verify_s = 0.01
            policy.exit_head.admit(record.tokens)  # as the engine commits them
            policy.observe(record)
            at += len(record.tokens)
        return policy

    def counted(policy: FastDynamicExit) -> float:
        return float(policy.stats.evidence()[policy.final_rows].sum())

    assert counted(run(HELD_BATCH, HELD_BATCH - 1)) == 0  # all held back so far
    assert counted(run(HELD_BATCH, HELD_BATCH)) > 0  # a full batch is applied
    held, at_once = run(HELD_BATCH, 37), run(1, 37)
    assert counted(held) < counted(at_once)  # 5 rounds still wait
    held.apply_held()
    assert held.stats.sums == pytest.approx(at_once.stats.sums)
    assert held.context_score.stats.sums == pytest.approx(at_once.context_score.stats.sums)
    assert held.context_score.stats.sums.sum() > 0  # proposals were scored
    for kind in ("plain", "layer"):
        tokens_, _, rounds_ = held.realized.sums[kind]
        assert (tokens_, rounds_) == pytest.approx(at_once.realized.sums[kind][::2])
    # the same samples (a prediction less the policy's measured overhead: equal up to rounding)
    checked = list(held.cost.check.ratios[False])
    assert checked == pytest.approx(list(at_once.cost.check.ratios[False]), rel=1e-12)


def test_drafts_from_the_final_layer_run_to_the_optimum_whatever_their_confidence():
    """Confidence tells nothing there (a level drafts the target exactly when it holds it):
    the stop under tau applies at other layers, and at the final layer of int8 drafts."""
    model = tiny_model(seed=2, num_layers=4, dtype=torch.float32)
    for int8 in (False, True):
        policy = make_policy("del", 4, cost="measured", prior=0)
        policy.cost = MeasuredCost(profile([1.0] * 20, [0.5] * 20, [0.001, 0.002]), 4)
        policy.start(DraftHead(model, vocab=torch.arange(8), int8=int8, context_vocab=False))
        policy.tau_exit = 0.5
        policy.exit_layer = 4
        assert policy.keep_drafting(0.1) is not int8
        policy.exit_layer = 2
        assert not policy.keep_drafting(0.1)


def test_a_profile_recorded_under_load_is_corrected_within_100_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    model = tiny_model(seed=3, shallow=2)
    prompt = list(range(1, 30))
    first = make_policy("del-fast", model.num_layers)
    Decoding(model, prompt, first, max_new_tokens=4).run()  # measures and caches the profile
    (path,) = (tmp_path / "costs").glob("profile-*.json")
    stored = json.loads(path.read_text())
    busy = {**stored, "layer": [t * 100 for t in stored["layer"]]}
    busy["head"] = [t * 100 for t in stored["head"]]
    busy["draft_layer"] = stored["draft_layer"] * 100
    busy["draft_heads"] = {k: [t * 100 for t in v] for k, v in stored["draft_heads"].items()}
    path.write_text(json.dumps(busy))
    # a new process: nothing remembered from the first generation, the profile read from file
    policy = make_policy("del-fast", model.num_layers, remember=False)
    got = Decoding(model, prompt, policy, max_new_tokens=100).run()
    expected = Decoding(
        model, prompt, make_policy("ar", model.num_layers), max_new_tokens=100
    ).run()
    assert got.token_ids == expected.token_ids
    check = policy.cost.check
    assert check.corrections and check.corrections[0] < 1 / 3  # fired, and far off
    corrected = policy.cost.profile  # the numbers came down
    assert corrected.layer[0] < busy["layer"][0] / 3 and corrected.head[0] < busy["head"][0] / 3
    assert json.loads(path.read_text())["settled"] is False  # measured again next start


def _ran(policy, drafted: int, tokens: int, seconds: float) -> None:
    """`policy` sees a round that drafted `drafted` tokens from layer 8 (none: a plain step)
    and committed `tokens` in `seconds`."""
    record = Round(
        0, 8 if drafted else 0, [1] * drafted, [0.9] * drafted, 0, [1] * tokens,
        torch.zeros(1, dtype=torch.long),
    )  # fmt: skip
    record.verify_s = seconds
    policy.realized.add(record, 0.0)


def test_layer_drafts_that_really_run_slower_than_plain_steps_are_dropped():
    """The cost model promises a draft from layer 8; the rounds that ran say otherwise."""
    policy = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0)
    assert policy.plan().draft_cap > 0

    def ran(drafted, tokens, seconds):
        _ran(policy, drafted, tokens, seconds)

    for _ in range(4):
        ran(0, 1, 0.01)  # plain steps: 100 tokens/s
        ran(4, 3, 0.05)  # drafting rounds: 60 tokens/s
    policy._choose()
    assert policy.plan().draft_cap == 0 and policy.exit_layer == 8
    retried = []
    for round_ in range(40):
        drafted = policy.plan().draft_cap > 0
        if drafted:
            retried.append(round_)
        policy._recheck(changed=drafted)  # a round that drafted changed the statistics
    assert retried == [16, 33]  # after 16 plain rounds, one drafts again, to look again
    for _ in range(20):
        ran(4, 5, 0.03)  # drafting rounds now deliver 167 tokens/s
    policy._choose()
    assert policy.plan().draft_cap > 0


def test_layer_drafts_are_compared_with_a_recent_plain_step():
    """Drafting rounds ran but no plain step recently: one round is plain, to see what a
    plain step delivers now; drafts that beat it go on, until it fades from memory."""
    policy = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0)
    for _ in range(4):
        _ran(policy, 4, 3, 0.02)  # drafting rounds: 150 tokens/s
    policy._choose()
    assert policy.plan().draft_cap == 0  # a plain round, to compare with
    _ran(policy, 0, 1, 0.01)  # a plain step: 100 tokens/s
    policy._recheck(changed=False)  # looked at again after that one round
    assert policy.plan().draft_cap > 0
    for _ in range(40):
        _ran(policy, 4, 3, 0.02)
    policy._choose()
    assert policy.plan().draft_cap > 0  # 40 rounds on, still recent enough
    for _ in range(10):
        _ran(policy, 4, 3, 0.02)
    policy._choose()
    assert policy.plan().draft_cap == 0  # 50 rounds on: look again


def test_a_generation_starts_from_what_the_previous_one_learned(tmp_path, monkeypatch):
    """del-fast's second generation on a model skips the warm-up: the statistics, realized
    speeds and measured cost of the first carry over (with a bounded evidence), and the
    output is still the model's own."""
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    model = tiny_model(seed=5, shallow=2)
    head = DraftHead(model, vocab=[torch.arange(16), None], context_vocab=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    expected = Decoding(model, prompt, make_policy("ar", model.num_layers), max_new_tokens=40).run()
    memory = {}  # what the model's runs learned, kept by its owner (`LoadedModel.learned`)

    first = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory))
    got = Decoding(model, prompt, first, max_new_tokens=40, exit_head=head, trace=True).run()
    assert got.token_ids == expected.token_ids
    assert first.warmup_window > 0 and got.trace[0]["scored_layers"] > 0  # a warm-up

    second = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory))
    got = Decoding(model, prompt, second, max_new_tokens=40, exit_head=head, trace=True).run()
    assert got.token_ids == expected.token_ids
    assert second.warmup_window == 0 and got.trace[0]["scored_layers"] == 0  # none
    assert second.cost is first.cost  # corrections to the cost stay for the process
    # a generation starts from the latest one's rates, with at most CARRIED_EVIDENCE positions
    # of evidence: less of a long run's, all of a short one's (which would otherwise shrink
    # away over a run of short replies, each then paying a warm-up again)
    for learned, carried in ((48.0, 6.0), (3.0, 3.0), (3.0, 3.0)):
        latest = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory))
        latest.start(head.for_prompt(prompt))
        latest.stats.matched[:], latest.stats.mismatched[:] = learned, learned / 3  # learned
        then = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory))
        then.start(head.for_prompt(prompt))
        assert then.warmup_window == 0
        np.testing.assert_allclose(then.stats.matched, carried)
        np.testing.assert_allclose(then.stats.mismatched, carried / 3)

    opted_out = {"remember": False}
    alone = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory), **opted_out)
    assert memory  # the first runs left what they learned with their owner
    got = Decoding(model, prompt, alone, max_new_tokens=40, exit_head=head, trace=True).run()
    assert got.token_ids == expected.token_ids and got.trace[0]["scored_layers"] > 0


def test_a_carried_verdict_against_layer_drafts_is_judged_again_within_a_bound(
    tmp_path, monkeypatch
):
    """A generation that found its layer drafts slower than plain steps (a busy moment) hands
    the next one that verdict with at most CARRIED_ROUNDS rounds of each kind behind it: the
    same rates, so it starts from the verdict, but once the new generation's plain rounds have
    decayed them below REALIZED_ROUNDS, layer drafts are judged again from its own rounds."""
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    model = tiny_model(seed=5, shallow=2)
    head = DraftHead(model, vocab=[torch.arange(16), None], context_vocab=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    memory = {}
    first = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory))
    Decoding(model, prompt, first, max_new_tokens=24, exit_head=head).run()
    for _ in range(60):  # a long run in which layer drafts lost: 60 tokens/s against 100
        _ran(first, 0, 1, 0.01)
        _ran(first, 4, 3, 0.05)
    assert first.realized.verdict() == "lose"
    assert first.realized.sums["layer"][2] > 2 * fast_state.CARRIED_ROUNDS  # more than it hands on

    second = make_policy("del-fast", model.num_layers, PolicyInputs(learned=memory))
    second.start(head.for_prompt(prompt))
    carried = second.realized
    assert carried is not first.realized and carried.verdict() == "lose"
    for kind in ("plain", "layer"):
        tokens, seconds, rounds = carried.sums[kind]
        before = first.realized.sums[kind]
        assert rounds == pytest.approx(fast_state.CARRIED_ROUNDS)
        assert tokens / seconds == pytest.approx(before[0] / before[1])  # the same rates
    plain_rounds = 0
    while carried.verdict() == "lose" and plain_rounds < 100:  # bounded: a failure, not a hang
        _ran(second, 0, 1, 0.01)
        plain_rounds += 1
    assert carried.verdict() == "draft"  # too little evidence left: layer drafts run again
    assert plain_rounds == 23  # 6 rounds decayed by 0.97 a round fall below 3 after 23


def test_policy_work_is_noted_apart_for_rounds_with_layer_drafts():
    """Counting a layer's drafts and choosing again cost more than a plain round's bookkeeping:
    each kind of round charges its own decayed overhead to the cost model."""
    policy = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0, shadow_budget=0.01)
    policy.in_warmup = False
    cost = policy.cost
    policy.observe(Round(10, 0, [], [], 0, [7], torch.tensor([7])))
    assert cost.overhead == 0  # a plain round's updates wait for the next round's...
    policy.observe(Round(11, 8, [3, 4], [0.9, 0.9], 2, [3, 4, 5], torch.tensor([3, 4, 5])))
    assert cost.overhead > 0 and cost.layer_overhead > 0  # ...which takes them first
    plain = cost.overhead
    policy.observe(Round(14, 8, [3, 4], [0.9, 0.9], 2, [3, 4, 5], torch.tensor([3, 4, 5])))
    assert cost.overhead == plain


def test_the_confidence_stop_holds_only_while_drafts_under_it_miss():
    """Drafting stops under the exit layer's threshold tau (the paper's rule) until drafts made
    under tau are seen accepted often enough to pay; seen missing, the stop holds again."""
    policy = _policy_with_counts([2, 5, 95], [8, 5, 5], no_draft=True, prior=0, shadow_budget=0.01)
    policy.stats.confidence_matched = policy.stats.matched * 0.9
    policy.stats.confidence_mismatched = policy.stats.mismatched * 0.3
    policy._choose()
    plan = policy.plan()
    assert plan.exit_layer == 8 and plan.draft_cap >= 2
    assert policy.tau_exit == pytest.approx(0.6)
    assert policy.keep_drafting(0.7) and not policy.keep_drafting(0.4)

    def drafted(confidences: list[float], accepted: int) -> None:
        """A round of drafts from layer 8 with these confidences, `accepted` of them accepted."""
        n = len(confidences)
        tokens = [1] * accepted + [2]
        targets = torch.tensor(tokens + [0] * (n + 1 - len(tokens)))
        policy.observe(Round(20, 8, [1] * n, confidences, accepted, tokens, targets))

    policy.in_warmup = False
    for _ in range(4):  # each draft's last token under tau, and accepted
        drafted([0.9, 0.4], 2)
    assert policy.keep_drafting(0.4)
    for _ in range(12):  # under tau and missed
        drafted([0.9, 0.4], 1)
    assert not policy.keep_drafting(0.4) and policy.keep_drafting(0.7)
