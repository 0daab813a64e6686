"""Sampling: parameter checks, and speculative sampling keeps the target distribution."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from test_context_drafts import Scripted
from test_lossless import AtLevel
from tiny_models import tiny_model

from delspec.decoding import decode_tokens
from delspec.draft_head import DraftHead
from delspec.errors import ConfigError
from delspec.policies import make_policy
from delspec.sampling import Sampling, greedy_tokens

VOCAB, NEW, SAMPLES = 6, 3, 2000
SIGNIFICANCE = 0.001  # a correct sampler fails this test with probability 0.1%


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=0.7, top_p=0.0), "top_p"),
        (dict(temperature=0.7, top_p=1.5), "top_p"),
        (dict(temperature=0.7, top_k=-2), "top_k"),
    ],
)
def test_invalid_sampling_parameters(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Sampling(**kwargs)


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert Sampling(1.0, top_k=2).probs(logits).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert Sampling(1.0, top_p=0.8).probs(logits).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert Sampling(1.0, top_p=0.81).probs(logits).tolist() == pytest.approx(
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_tokens_are_torch_argmax_with_the_first_of_ties(dtype):
    scores = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    scores[1, [7, 300, 40000]] = 50.0  # a tie: the first index wins
    scores[2] = 0.0  # all equal
    strided = scores[:, ::3]  # not contiguous
    for x in (scores, strided, scores[3], scores[1:2]):
        got = greedy_tokens(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert greedy_tokens(scores)[1:3].tolist() == [7, 0]


def exact_distribution(model, prompt, sampling):
    """P(x1..xN | prompt) for every continuation, from full forward passes."""
    probs = {}
    model.setup_cache(16)
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        logits = model(torch.tensor(prompt + list(seq[:-1])))[len(prompt) - 1 :]
        p = sampling.probs(logits)
        probs[seq] = float(torch.prod(p[torch.arange(NEW), torch.tensor(seq)]))
    return probs


@pytest.mark.parametrize(
    "strategy,options,draft_vocab,int8",
    [
        ("ar", {}, None, False),
        ("static", dict(exit_layer=2, draft_length=2), None, False),
        ("del", {}, None, False),
        # The final layer through a pruned head (tokens 0 and 3, plus the context's own).
        ("static", dict(exit_layer=-1, draft_length=2), [0, 3], False),
        ("static", dict(exit_layer=2, draft_length=2), None, True),
        # The middle one of three draft vocabularies: tokens 0, 1, 3 and the context's 4 and 2.
        ("level", dict(exit_layer=2, draft_length=2, level=1), [[0, 3], [0, 1, 3], None], False),
        ("lookup", dict(ngram_min=1, draft_length=2), None, False),
        # Two context tokens (a fixed script), then exit-layer drafts after them.
        ("scripted", dict(exit_layer=2), None, False),
        # Exit-layer drafts, then two context tokens (the script's) after them.
        ("scripted", dict(exit_layer=2, context=0, after=2), None, False),
    ],
)
def test_speculative_sampling_keeps_the_target_distribution(strategy, options, draft_vocab, int8):
    model = tiny_model(seed=7, shallow=2, residual_scale=0.3, vocab_size=VOCAB)
    prompt = [1, 4, 2]
    settings = dict(temperature=0.9, top_k=5)
    exact = exact_distribution(model, prompt, Sampling(**settings))
    if options.get("exit_layer") == -1:
        options = {**options, "exit_layer": model.num_layers}
    if draft_vocab is None or isinstance(draft_vocab[0], int):
        vocab = None if draft_vocab is None else torch.tensor(draft_vocab)
    else:
        vocab = [None if v is None else torch.tensor(v) for v in draft_vocab]
    head = DraftHead(model, vocab=vocab, int8=int8)
    counts: Counter = Counter()
    drafted = 0
    for seed in range(SAMPLES):
        if strategy == "level":
            policy = AtLevel(model.num_layers, **options)
        elif strategy == "scripted":
            script = [3, 1, 4, 1, 5, 2, 0]
            scripted = {"context": 2, **options}
            policy = Scripted(
                model.num_layers, script, correct=lambda r: 2, vocab=VOCAB, **scripted
            )
        else:
            policy = make_policy(strategy, model.num_layers, **options)
        out = decode_tokens(
            model,
            prompt,
            policy,
            sampling=Sampling(**settings, seed=seed),
            max_new_tokens=NEW,
            exit_head=head,
        )
        counts[tuple(out.token_ids)] += 1
        drafted += out.stats.drafted
    # drafts were really made and tested (context drafts: only where a token repeats)
    assert strategy == "ar" or drafted > (SAMPLES // 2 if strategy == "lookup" else SAMPLES)
    # Pool rare continuations so every chi-square cell expects at least 5 samples.
    cells = sorted(exact, key=exact.get, reverse=True)
    common = [c for c in cells if exact[c] * SAMPLES >= 5]
    rare = [c for c in cells if exact[c] * SAMPLES < 5]
    observed = [counts[c] for c in common] + [sum(counts[c] for c in rare)]
    expected = [exact[c] * SAMPLES for c in common] + [sum(exact[c] for c in rare) * SAMPLES]
    assert sum(counts.values()) == SAMPLES
    assert set(counts) <= {c for c in exact if exact[c] > 0}
    scale = SAMPLES / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > SIGNIFICANCE
