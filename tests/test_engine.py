"""The engine's round, step by step: a plain step, a draft verified and accepted, the stop rules
of a draft, and sequences in separate cache slots (float64 tiny models: exact)."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from delspec.decoding.engine import Engine
from delspec.decoding.sampling import Sampling

PROMPT = list(range(3, 15))


def engine(model, slot: int = 0, eos: tuple[int, ...] = ()) -> Engine:
    e = Engine(model, Sampling(), eos, slot=slot)
    e.prefill(PROMPT, 64)
    return e


def greedy(model, count: int) -> list[int]:
    """The model's own greedy continuation of PROMPT, one full pass per token."""
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(count):
            model.setup_cache(len(ids))
            ids.append(int(model(torch.tensor(ids))[-1].argmax()))
    return ids[len(PROMPT) :]


def test_a_plain_step_commits_the_models_greedy_token():
    model = tiny_model(seed=1)
    expected = greedy(model, 1)
    record = engine(model).round(exit_layer=3, draft_cap=0, keep_drafting=lambda c: True)
    assert (record.exit_layer, record.drafted, record.accepted) == (0, [], 0)
    assert record.tokens == expected and record.targets.tolist() == expected
    assert record.logits.shape == (1, model.config.vocab_size)


def test_a_draft_is_verified_in_one_pass_and_its_agreeing_prefix_accepted():
    model = tiny_model(seed=3, shallow=2)
    expected = greedy(model, 6)
    record = engine(model).round(exit_layer=2, draft_cap=5, keep_drafting=lambda c: True)
    n = len(record.drafted)
    assert n == 5 and len(record.confidences) == 5
    assert record.targets.shape == (n + 1,)  # after the input and after each draft token
    agree = next((i for i in range(n) if record.drafted[i] != expected[i]), n)
    assert record.accepted == agree and record.accepted > 0
    assert record.tokens == expected[: record.accepted + 1]


def test_drafting_stops_when_the_policy_says_or_at_eos():
    model = tiny_model(seed=3, shallow=2)
    first = engine(model).round(2, 5, keep_drafting=lambda c: False)
    assert len(first.drafted) == 1  # one token, then the policy stopped it
    eos = first.drafted[0]
    stopped = engine(model, eos=(eos,)).round(2, 5, keep_drafting=lambda c: True)
    assert stopped.drafted == [eos]


def test_sequences_in_separate_slots_do_not_disturb_each_other():
    model = tiny_model(seed=1)
    expected = greedy(model, 4)
    with torch.inference_mode():
        model.setup_cache(64, 2)
    a, b = engine(model, slot=0), engine(model, slot=1)
    b.tokens[-1] = (b.tokens[-1] + 7) % 64  # a different sequence in slot 1
    for _ in range(4):
        a.round(0, 0, keep_drafting=lambda c: True)
        b.round(0, 0, keep_drafting=lambda c: True)
    assert a.tokens[len(PROMPT) :] == expected
