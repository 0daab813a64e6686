"""Sequences decoded together (`step_together`, cache slots) and alone (`Decoding.advance`):
each row's tokens are its solo tokens in any batch composition and arrival order, sampled ones
too; log-probabilities are the verifier's, the same under every strategy."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from delspec.decoding.batch import start_together, step_together
from delspec.decoding.sampling import Sampling
from delspec.decoding.sequence import Decoding
from delspec.drafting.batch_drafts import BatchDrafts
from delspec.machine.batching import paying_batch
from delspec.policies import make_policy

PROMPTS = [list(range(3, 12)), list(range(20, 23)), [5, 9, 14, 2, 7, 30, 31], [40]]


def solo(model, prompt, sampling=None, tokens=24):
    policy = make_policy("ar", model.num_layers)
    return Decoding(model, prompt, policy, sampling=sampling, max_new_tokens=tokens).run()


def slots(model, length, count):
    """A cache of `count` sequence slots, made as the engine writes it (in inference mode)."""
    with torch.inference_mode():
        model.setup_cache(length, count)


def decoding(model, prompt, slot, sampling=None, tokens=24, strategy="ar", logprobs=None,
             start=True):  # fmt: skip
    policy = make_policy(strategy, model.num_layers)
    d = Decoding(
        model, prompt, policy, sampling=sampling, max_new_tokens=tokens, slot=slot,
        logprobs=logprobs,
    )  # fmt: skip
    if start:
        d.start()
    return d


@pytest.mark.parametrize("compiled", [True, False], ids=["block weights", "float64 eager"])
def test_batched_steps_give_each_sequence_its_solo_tokens(compiled):
    model = tiny_model(seed=5, dtype=torch.float32, blocks=True) if compiled else tiny_model(seed=5)
    expected = [solo(model, p).token_ids for p in PROMPTS]
    slots(model, 64, len(PROMPTS))
    assert (model.compiled_layers() is not None) == compiled
    # arrivals and departures: sequences join at different steps and stop at their budgets
    budgets = [24, 9, 17, 24]
    active: list[Decoding] = []
    finished: dict[int, list[int]] = {}
    for step in range(40):
        if step in (0, 3):  # one arrives alone
            index = (0, 3).index(step)
            active.append(decoding(model, PROMPTS[index], index, tokens=budgets[index]))
        if step == 7:  # two arrive together: their prompts prefilled in one pass
            joining = [
                decoding(model, PROMPTS[i], i, tokens=budgets[i], start=False) for i in (2, 3)
            ]
            start_together(joining)
            active += joining
        if not active:
            break
        step_together(active)
        for d in [d for d in active if d.done]:
            finished[d.slot] = d.finish().token_ids
            active.remove(d)
    assert finished == {i: expected[i][: budgets[i]] for i in range(len(PROMPTS))}


@pytest.mark.parametrize("compiled", [True, False], ids=["block weights", "float64 eager"])
def test_context_drafts_in_batched_steps_keep_each_sequences_solo_tokens(compiled):
    """Sequences that draft from their context verify those drafts in the batched pass (as
    many as `BatchDrafts` finds paying on a step cost that grows slowly with rows): their
    tokens are still their solo greedy tokens, and drafts were verified."""
    model = tiny_model(seed=5, dtype=torch.float32, blocks=True) if compiled else tiny_model(seed=5)
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9] * 5, PROMPTS[2]]
    expected = [solo(model, p, tokens=30).token_ids for p in prompts]
    slots(model, 80, len(prompts))
    drafts = BatchDrafts({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.14, 16: 1.3, 32: 1.6})
    batch = [
        decoding(model, p, i, tokens=30, strategy=strategy)
        for i, (p, strategy) in enumerate(zip(prompts, ("lookup", "del-fast", "ar"), strict=True))
    ]
    assert batch[2].proposal(drafts.limit) == []  # `ar` does not draft from its context
    verified = 0
    while not all(d.done for d in batch):
        active = [d for d in batch if not d.done]
        chosen = drafts.choose([d.proposal(drafts.limit) for d in active])
        committed = step_together(active, chosen)
        drafts.observe(chosen, [accepted for _, accepted in committed])
        verified += sum(map(len, chosen))
    assert [d.finish().token_ids for d in batch] == expected
    assert verified > 0 and sum(d.totals.stats.context_drafted for d in batch) == verified


def test_batched_sampling_draws_what_each_sequence_draws_alone():
    model = tiny_model(seed=6, dtype=torch.float32, blocks=True)
    samplings = [Sampling(temperature=0.9, top_p=0.95, seed=s) for s in range(3)]
    expected = [solo(model, p, s).token_ids for p, s in zip(PROMPTS[:3], samplings, strict=True)]
    slots(model, 64, 3)
    batch = [
        decoding(model, p, i, s)
        for i, (p, s) in enumerate(zip(PROMPTS[:3], samplings, strict=True))
    ]
    while not all(d.done for d in batch):
        step_together([d for d in batch if not d.done])
    assert [d.finish().token_ids for d in batch] == expected


def test_a_sequence_may_switch_between_its_own_rounds_and_batched_steps():
    """A server runs a lone sequence's speculative rounds and batches it with others when they
    come: the tokens are its solo greedy tokens throughout."""
    model = tiny_model(seed=3, dtype=torch.float32, blocks=True, shallow=2)
    expected = solo(model, PROMPTS[0], tokens=40).token_ids
    slots(model, 80, 2)
    lone = decoding(model, PROMPTS[0], 0, tokens=40, strategy="del-fast")
    other = decoding(model, PROMPTS[2], 1, tokens=40)
    for step in range(60):
        if lone.done:
            break
        if step % 5 < 2:
            lone.advance()
        else:
            step_together([lone] + ([] if other.done else [other]))
    assert lone.finish().token_ids == expected


def test_log_probabilities_are_the_verifiers_under_every_strategy():
    model = tiny_model(seed=3, dtype=torch.float32, blocks=True, shallow=2)
    slots(model, 64, 1)
    results = {}
    for strategy in ("ar", "static", "del-fast"):
        d = decoding(model, PROMPTS[0], 0, tokens=20, strategy=strategy, logprobs=3)
        while not d.done:
            d.advance()
        results[strategy] = d.finish()
    reference = results["ar"]
    assert len(reference.logprobs) == len(reference.token_ids) == 20
    for token, (value, top) in zip(reference.token_ids, reference.logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == value and len(top) == 3  # greedy: the best
        assert value <= 0.0
    for strategy in ("static", "del-fast"):
        assert results[strategy].token_ids == reference.token_ids
        assert results[strategy].logprobs == reference.logprobs, strategy
    assert results["static"].stats.drafted > 0  # the comparison covered verified drafts


def test_the_paying_batch_is_the_smallest_within_reach_of_the_fastest() -> None:
    # tokens per second: 1 row 200, 2 rows 333, 4 rows 444, 8 rows 470 (+6%), 16 rows 480 (+2%)
    seconds = {1: 0.005, 2: 0.006, 4: 0.009, 8: 0.017, 16: 0.0333}
    assert paying_batch(seconds) == 8  # within 5% of 16's
    # 8 rows timed in a slow moment (457 tokens/s: +3% over 4) no longer stop the batch at 4:
    # 16 gives 8% more than 4, and 8 is not within 5% of it
    assert paying_batch({**seconds, 8: 0.0175}) == 16
    assert paying_batch({**seconds, 8: 0.0175, 16: 0.0366}) == 4  # 437 tokens/s: none beats 4
    assert paying_batch({1: 0.005, 2: 0.0098}) == 1
    assert paying_batch({1: 0.005}) == 1
