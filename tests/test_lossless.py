"""Every policy reproduces autoregressive greedy output token for token (float64, exact)."""

from __future__ import annotations

import pytest
import torch
from helpers import POLICIES, AtLevel, run
from tiny_models import tiny_model

from delspec.decoding.sequence import Decoding
from delspec.drafting.draft_head import DraftHead
from delspec.policies import STRATEGIES


def test_every_strategy_is_covered():
    assert set(POLICIES) | {"ar"} == set(STRATEGIES)


@pytest.mark.parametrize("strategy", sorted(POLICIES))
@pytest.mark.parametrize("shallow", [None, 2])
@pytest.mark.parametrize("int8", [False, True])
def test_greedy_matches_autoregressive(strategy, shallow, int8):
    check_greedy_matches_autoregressive(strategy, shallow, int8)


@pytest.mark.parametrize("strategy", sorted(POLICIES))
@pytest.mark.parametrize("shallow", [None, 2])
def test_greedy_matches_autoregressive_on_block_weights(strategy, shallow):
    """On a model held in GGUF blocks (here Q8_0), `ar` on those weights is the reference."""
    check_greedy_matches_autoregressive(strategy, shallow, blocks=True)


def check_greedy_matches_autoregressive(strategy, shallow, int8=False, blocks=False):
    for seed in range(6):
        model = tiny_model(seed=seed, shallow=shallow, blocks=blocks)
        gen = torch.Generator().manual_seed(100 + seed)
        for prompt_len, max_new in [(1, 9), (5, 33), (37, 20)]:
            prompt = torch.randint(0, 64, (prompt_len,), generator=gen).tolist()
            expected, _ = run(model, prompt, "ar", max_new)
            got, records = run(model, prompt, strategy, max_new, (), int8, **POLICIES[strategy])
            assert got.token_ids == expected.token_ids, (seed, prompt_len, max_new)
            assert len(got.token_ids) == max_new
            assert sum(len(r.tokens) for r in records) == max_new


@pytest.mark.parametrize("strategy", sorted(POLICIES))
@pytest.mark.parametrize("int8", [False, True])
def test_all_acceptance_paths_are_exercised(strategy, int8):
    """Near-identity later layers: drafts are often accepted, so every path of a round runs."""
    seen = {"multi_accept": 0, "all_accepted_bonus": 0, "rejection": 0, "budget_cut": 0}
    for seed in range(8):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1)
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        max_new = 23 + seed
        expected, _ = run(model, prompt, "ar", max_new)
        got, records = run(model, prompt, strategy, max_new, (), int8, **POLICIES[strategy])
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


# (context drafts propose an EOS only where one occurred before: test_context_drafts tests it)
@pytest.mark.parametrize("strategy", sorted(set(POLICIES) - {"lookup"}))
@pytest.mark.parametrize("int8", [False, True])
def test_eos_inside_a_draft_ends_output_like_autoregressive(strategy, int8):
    hits = 0
    for seed in range(8):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1)
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        free, _ = run(model, prompt, "ar", 30)
        eos = (free.token_ids[12],)  # a token the model produces mid-sequence
        expected, _ = run(model, prompt, "ar", 30, eos)
        assert expected.token_ids[-1] == eos[0] and expected.finish_reason == "stop"
        got, records = run(model, prompt, strategy, 30, eos, int8, **POLICIES[strategy])
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


def test_int8_drafts_leave_the_exact_cache_behind():
    """Verification after int8 drafts rewrites every layer's keys and values: the cache of the
    committed positions equals that of plain decoding, to float64 rounding."""
    model = tiny_model(seed=4, shallow=2, residual_scale=0.3)
    prompt = list(range(7))
    expected, _ = run(model, prompt, "ar", 30)
    ar_cache = model.cache.clone()
    got, records = run(model, prompt, "static", 30, (), True, exit_layer=2, draft_length=4)
    assert got.token_ids == expected.token_ids
    assert any(0 < r.accepted < len(r.drafted) for r in records)  # rejected drafts too
    committed = len(prompt) + 30 - 1  # the last token is never run through the model
    torch.testing.assert_close(
        model.cache[..., :committed, :], ar_cache[..., :committed, :], rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("int8", [False, True])
def test_every_draft_vocabulary_level_is_lossless(level, int8):
    """Drafts from each level of a pruned ladder (8 tokens, 24 tokens, all; plus the context's
    own) map their columns back to the right tokens."""
    accepted = drafted = 0
    for seed in range(4):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.1)
        ranking = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
        head = DraftHead(model, None, [ranking[:8].sort().values, ranking[:24], None], int8=int8)
        prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected, _ = run(model, prompt, "ar", 30)
        for exit_layer in (2, model.num_layers):
            policy = AtLevel(model.num_layers, level, exit_layer=exit_layer, draft_length=3)
            got = Decoding(model, prompt, policy, max_new_tokens=30, exit_head=head).run()
            assert got.token_ids == expected.token_ids, (seed, exit_layer)
            accepted, drafted = accepted + got.stats.accepted, drafted + got.stats.drafted
    assert 0 < accepted < drafted  # accepted and rejected drafts
