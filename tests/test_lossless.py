"""Every policy reproduces autoregressive greedy output token for token (float64, exact)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from delspec.engine import Round
from delspec.generate import decode_tokens
from delspec.policies import STRATEGIES, make_policy

POLICIES = {
    "static": dict(exit_layer=2, draft_length=4),
    "fs": dict(exit_layer=3, draft_length=2),
    "dv": dict(exit_layer=2),
    "del": dict(),
    "dele": dict(),
    "del-fast": dict(warmup=4),  # evidence from the prompt: drafting starts within ~25 tokens
}


def test_every_strategy_is_covered():
    assert set(POLICIES) | {"ar"} == set(STRATEGIES)


def run(model, prompt, strategy, max_new, eos=(), **options):
    policy = make_policy(strategy, model.num_layers, **options)
    records: list[Round] = []
    observe = policy.observe
    policy.observe = lambda record: (records.append(record), observe(record))[-1]
    out = decode_tokens(model, prompt, policy, max_new_tokens=max_new, eos_token_ids=eos)
    return out, records


@pytest.mark.parametrize("strategy", sorted(POLICIES))
@pytest.mark.parametrize("shallow", [None, 2])
def test_greedy_matches_autoregressive(strategy, shallow):
    for seed in range(6):
        model = tiny_model(seed=seed, shallow=shallow)
        gen = torch.Generator().manual_seed(100 + seed)
        for prompt_len, max_new in [(1, 9), (5, 33), (37, 20)]:
            prompt = torch.randint(0, 64, (prompt_len,), generator=gen).tolist()
            expected, _ = run(model, prompt, "ar", max_new)
            got, records = run(model, prompt, strategy, max_new, **POLICIES[strategy])
            assert got.token_ids == expected.token_ids, (seed, prompt_len, max_new)
            assert len(got.token_ids) == max_new
            assert sum(len(r.tokens) for r in records) == max_new


@pytest.mark.parametrize("strategy", sorted(POLICIES))
def test_all_acceptance_paths_are_exercised(strategy):
    """Near-identity later layers: drafts are often accepted, so every path of a round runs."""
    seen = {"multi_accept": 0, "all_accepted_bonus": 0, "rejection": 0, "budget_cut": 0}
    for seed in range(8):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1)
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        max_new = 23 + seed
        expected, _ = run(model, prompt, "ar", max_new)
        got, records = run(model, prompt, strategy, max_new, **POLICIES[strategy])
        assert got.token_ids == expected.token_ids
        for r in records:
            n = len(r.drafted)
            seen["multi_accept"] += r.accepted >= 2
            seen["all_accepted_bonus"] += n > 0 and r.accepted == n and len(r.tokens) == n + 1
            seen["rejection"] += r.accepted < n
        last = records[-1]
        budget = max_new - sum(len(r.tokens) for r in records[:-1])
        seen["budget_cut"] += len(last.drafted) == budget - 1 == last.accepted > 0
    assert all(seen.values()), seen


@pytest.mark.parametrize("strategy", sorted(POLICIES))
def test_eos_inside_a_draft_ends_output_like_autoregressive(strategy):
    hits = 0
    for seed in range(8):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1)
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        free, _ = run(model, prompt, "ar", 30)
        eos = (free.token_ids[12],)  # a token the model produces mid-sequence
        expected, _ = run(model, prompt, "ar", 30, eos)
        assert expected.token_ids[-1] == eos[0] and expected.finish_reason == "stop"
        got, records = run(model, prompt, strategy, 30, eos, **POLICIES[strategy])
        assert got.token_ids == expected.token_ids
        assert got.finish_reason == "stop"
        last = records[-1]
        hits += eos[0] in last.drafted[: last.accepted]
    assert hits, "no run accepted an EOS token from inside a draft"


def test_context_end_stops_with_length():
    model = tiny_model(seed=1, shallow=2, max_position=40)
    prompt = list(range(30))
    expected, _ = run(model, prompt, "ar", 50)
    got, _ = run(model, prompt, "del", 50)
    assert len(expected.token_ids) == 10 and expected.finish_reason == "length"
    assert got.token_ids == expected.token_ids
