"""Sampling: parameter checks, draws that follow the processed distribution's definition with
every control, and speculation that keeps it (the same tokens as `ar` with the same seed)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import POLICIES, AtLevel, Scripted
from scipy.stats import chisquare
from tiny_models import tiny_model

from delspec.decoding import sampling as sampling_module
from delspec.decoding.sampling import Sampler, Sampling
from delspec.decoding.sequence import Decoding
from delspec.drafting.draft_head import DraftHead
from delspec.errors import ConfigError
from delspec.kernels.scores import greedy_tokens
from delspec.policies import make_policy

VOCAB, NEW, SAMPLES = 6, 3, 2000
SIGNIFICANCE = 0.001  # a correct sampler fails this test with probability 0.1%


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=0.7, top_p=0.0), "top_p"),
        (dict(temperature=0.7, top_p=1.5), "top_p"),
        (dict(temperature=0.7, top_k=-2), "top_k"),
        (dict(temperature=0.7, min_p=1.5), "min_p"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-3), "presence_penalty"),
        (dict(presence_penalty="high"), "presence_penalty must be a number"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={3: 101}), "logit_bias values"),
        (dict(logit_bias={-1: 5}), "logit_bias keys"),
        (dict(logit_bias={"x": 5}), "logit_bias keys"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
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


def test_logit_bias_keys_may_be_digit_strings_and_a_bias_outside_the_vocabulary_is_refused():
    sampling = Sampling(0.5, logit_bias={"7": -100, 2: 1.5})
    assert sampling.logit_bias == ((2, 1.5), (7, -100.0))
    with pytest.raises(ConfigError, match="logit_bias token id 7 is not in the vocabulary"):
        Sampler(sampling, 7, [1])


def test_penalties_and_bias_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    s = Sampling(
        0.5, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
        logit_bias={4: 10.0},
    )  # fmt: skip
    # token 0 in the prompt: repetition only; 2 twice and 1 once in the output: all penalties
    got = s.adjusted(logits, prompt=[0], output=[2, 1, 2]).tolist()
    assert got == pytest.approx([1.0, -2.0 - 0.75, 0.25 - 1.25, 3.0, 8.0])


CONTROLS = [
    dict(temperature=0.8),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=0.9, top_k=7, top_p=0.85, min_p=0.02),
    dict(
        temperature=1.1, top_p=0.95, frequency_penalty=0.6, presence_penalty=-0.4,
        repetition_penalty=1.4, logit_bias={0: 1.5, 5: -100},
    ),
]  # fmt: skip


@pytest.mark.parametrize("deltas", [None, (0.5, 1.0, math.inf)])
@pytest.mark.parametrize("settings", CONTROLS)
def test_draws_follow_the_definition_over_the_whole_vocabulary(settings, deltas, monkeypatch):
    """Many positions' draws from one row of logits: their counts fit `Sampling.probs`. With
    narrow candidate sets (`deltas`), kept sets reach past the first candidates (widened) and
    pure temperature draws from the tail item."""
    if deltas:
        monkeypatch.setattr(sampling_module, "DELTAS", deltas)
    vocab, draws = 24, 6000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    prompt, output, before = [3, 9], [9, 2, 2], [4]
    sampling = Sampling(**settings, seed=11)
    exact = sampling.probs(logits, prompt, output + before).numpy()
    sampler = Sampler(sampling, vocab, prompt)
    sampler.add(output)
    counts = np.zeros(vocab)
    for position in range(draws):
        token, p = sampler.draw(logits.numpy(), position, before)
        counts[token] += 1
        assert p == pytest.approx(exact[token])
    assert not counts[exact == 0].any()
    common = exact * draws >= 5
    rare = (exact > 0) & ~common  # pooled as one cell, if any
    pooled = [rare.any()] if rare.any() else []
    observed = [*counts[common], *[counts[rare].sum() for _ in pooled]]
    expected = [*(exact[common] * draws), *[exact[rare].sum() * draws for _ in pooled]]
    assert chisquare(observed, expected).pvalue > SIGNIFICANCE


def test_a_nucleus_reaching_past_the_first_candidates_is_widened_not_cut(monkeypatch):
    """Candidates within 1 of the top logit (tokens 0 and 1) hold 75% of the mass; top-p 0.9
    keeps 19 more (ties in id order), and every kept token is drawn."""
    monkeypatch.setattr(sampling_module, "DELTAS", (1.0, 2.0, math.inf))
    logits = torch.tensor([4.0, 3.5] + [0.0] * 30 + [-30.0] * 8, dtype=torch.float64)
    sampling = Sampling(1.0, top_p=0.9, seed=0)
    kept = set(np.flatnonzero(sampling.probs(logits).numpy()).tolist())
    assert kept == set(range(21))
    sampler = Sampler(sampling, len(logits), [])
    assert {sampler.draw(logits.numpy(), position)[0] for position in range(3000)} == kept


@pytest.mark.parametrize(
    "settings,body,positions",
    [
        (dict(top_p=0.9), 400, 1),
        (dict(top_p=0.5, min_p=0.001), 400, 1),
        (dict(top_k=300, top_p=0.95), 400, 1),
        (dict(), 10, 50),  # the outside item wins about once in 500 draws
    ],
)
def test_bounds_on_the_vocabulary_s_mass_draw_what_its_exact_sum_draws(
    settings, body, positions, monkeypatch
):
    """Draws that bound the whole row's mass (summing it only when the bounds leave a draw
    undecided) are those of the exact sum, token and probability: on rows whose mass lies
    partly in many tokens just outside the first candidates, top-p's cut and whether the
    outside item wins depend on it."""
    vocab, rows = 30000, 60
    g = torch.Generator().manual_seed(4)
    logits = torch.full((rows, vocab), -40.0)
    logits[:, 0] = 0.0
    logits[:, 1:body] = -torch.rand(rows, body - 1, generator=g) * 9 - 1
    logits[:, body:] = -16.05 - torch.rand(rows, vocab - body, generator=g) * 0.1
    sampling = Sampling(temperature=1.0, **settings, seed=7)
    sampler = Sampler(sampling, vocab, [])
    confidence = sampling.truncates  # (an untruncated probability always sums the row)

    def draws():
        return [
            sampler.draw(row, i * positions + j, confidence=confidence)
            for i, row in enumerate(logits.numpy())
            for j in range(positions)
        ]

    fast = draws()

    def exact_only(row, mass, columns, delta):
        yield row.total, row.total

    monkeypatch.setattr(sampling_module._Row, "bounds", exact_only)
    exact = draws()
    assert [t for t, _ in fast] == [t for t, _ in exact]
    if confidence:
        assert [p for _, p in fast] == pytest.approx([p for _, p in exact], rel=1e-9)


def test_candidates_sorted_level_by_level_draw_what_one_sort_of_all_draws(monkeypatch):
    """The kept set found in the candidates nearest the top first, each wider level sorting only
    the candidates the last did not hold (`SUBLEVELS`), draws the tokens and probabilities that
    one sort of every candidate draws: on rows whose kept set ends within each level, past them
    all, and with ties across the levels."""
    rng = np.random.default_rng(5)
    vocab = 40000
    rows = [(rng.standard_normal(vocab) * scale).astype(np.float32) for scale in (1.5, 2.5, 4.0)]
    for low, spread in ((6, 4), (6, 8), (6, 12), (12, 4)):  # the mass far below the top
        row = np.full(vocab, -40.0, dtype=np.float32)
        row[0], row[1:] = 0.0, -rng.random(vocab - 1) * spread - low
        rows.append(row)
    tied = np.full(vocab, -9.0, dtype=np.float32)  # ties with the level edges, in id order
    tied[:5], tied[5:3000], tied[3000:9000] = 0.0, -8.0, -12.0
    rows.append(tied)
    settings = [
        dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.99), dict(top_k=5000, top_p=0.95),
        dict(min_p=1e-5), dict(top_p=0.97, min_p=1e-6),
    ]  # fmt: skip

    def draws():
        out = []
        for i, kwargs in enumerate(settings):
            sampler = Sampler(Sampling(temperature=1.0, seed=i, **kwargs), vocab, [])
            out += [sampler.draw(row, position) for position, row in enumerate(rows)]
        return out

    levels = draws()
    monkeypatch.setattr(sampling_module, "SUBLEVELS", ())
    assert levels == draws()


def test_a_draw_is_a_function_of_seed_position_and_distribution():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2)).numpy()
    sampling = Sampling(0.8, top_p=0.95, seed=5)
    a, b = Sampler(sampling, 300, [1, 2]), Sampler(sampling, 300, [7])
    tokens = [a.draw(logits, p)[0] for p in range(50)]
    assert tokens == [b.draw(logits, p)[0] for p in range(50)]  # another history, same draws
    assert tokens == [a.draw(logits, p)[0] for p in range(50)]  # drawing again changes nothing
    other = Sampler(Sampling(0.8, top_p=0.95, seed=6), 300, [1, 2])
    assert tokens != [other.draw(logits, p)[0] for p in range(50)]
    # the draws over a vocabulary given as columns are those of the same logits by token id
    order = np.random.default_rng(0).permutation(300)
    assert tokens == [a.draw(logits[order], p, vocab=order)[0] for p in range(50)]
    unseeded = Sampling(0.8, top_p=0.95)
    first = [Sampler(unseeded, 300, []).draw(logits, p)[0] for p in range(50)]
    assert first != [Sampler(unseeded, 300, []).draw(logits, p)[0] for p in range(50)]


def exact_distribution(model, prompt, sampling):
    """P(x1..xN | prompt) for every continuation, from full forward passes."""
    probs = {}
    model.setup_cache(16)
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        logits = model(torch.tensor(prompt + list(seq[:-1])))[len(prompt) - 1 :]
        p = [sampling.probs(logits[i], prompt, seq[:i])[seq[i]] for i in range(NEW)]
        probs[seq] = float(torch.prod(torch.stack(p)))
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
    check_distribution(strategy, options, draft_vocab, int8, dict(temperature=0.9, top_k=5))


@pytest.mark.parametrize(
    "strategy,options,int8",
    [
        ("ar", {}, False),
        ("static", dict(exit_layer=2, draft_length=2), True),
        ("del", {}, False),
        ("lookup", dict(ngram_min=1, draft_length=2), False),
    ],
)
def test_speculation_keeps_the_distribution_with_every_control(strategy, options, int8):
    controls = dict(
        temperature=1.1, top_p=0.9, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3,
        repetition_penalty=1.3, logit_bias={2: 1.0},
    )  # fmt: skip
    check_distribution(strategy, options, None, int8, controls)


def check_distribution(strategy, options, draft_vocab, int8, settings):
    """Continuations of every strategy's seeded runs (one seed each) fit the exact
    distribution of NEW tokens (chi-square)."""
    model = tiny_model(seed=7, shallow=2, residual_scale=0.3, vocab_size=VOCAB)
    prompt = [1, 4, 2]
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
        out = Decoding(
            model,
            prompt,
            policy,
            sampling=Sampling(**settings, seed=seed),
            max_new_tokens=NEW,
            exit_head=head,
        ).run()
        counts[tuple(out.token_ids)] += 1
        drafted += out.stats.drafted
    # drafts were really made and tested (context drafts: only where a token repeats)
    assert strategy == "ar" or drafted > (SAMPLES // 2 if strategy == "lookup" else SAMPLES)
    # Pool rare continuations so every chi-square cell expects at least 5 samples.
    cells = sorted(exact, key=exact.get, reverse=True)
    common = [c for c in cells if exact[c] * SAMPLES >= 5]
    rare = [c for c in cells if 0 < exact[c] * SAMPLES < 5]
    observed = [counts[c] for c in common] + ([sum(counts[c] for c in rare)] if rare else [])
    expected = [exact[c] * SAMPLES for c in common]
    expected += [sum(exact[c] for c in rare) * SAMPLES] if rare else []
    assert sum(counts.values()) == SAMPLES
    assert set(counts) <= {c for c in exact if exact[c] > 0}
    scale = SAMPLES / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > SIGNIFICANCE


SEEDED = [
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=8, min_p=0.05, repetition_penalty=1.2, logit_bias={5: 2.0}),
    dict(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.3, logit_bias={7: -100}),
]


@pytest.mark.parametrize("strategy", sorted(POLICIES))
@pytest.mark.parametrize("int8", [False, True])
def test_seeded_output_is_ar_s_under_every_strategy(strategy, int8, tmp_path, monkeypatch):
    """Same seed, same tokens: every strategy (drafting from any layer, int8 drafts, pruned
    draft vocabularies, context drafts) commits `ar`'s tokens, with every control (penalised
    greedy decoding included). del-fast's costs are measured here, not read from a profile
    another process measured (on a busy machine it may find drafting too dear)."""
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    drafted = 0
    for seed, settings in enumerate(SEEDED):
        model = tiny_model(seed=seed, shallow=2, residual_scale=0.3)
        vocab = torch.arange(0, 64, 2) if seed % 2 else None  # a pruned draft vocabulary
        prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(seed))
        sampling = Sampling(**settings, seed=100 + seed)
        ar = Decoding(
            model, prompt.tolist(), make_policy("ar", 4), sampling=sampling, max_new_tokens=40
        ).run()
        policy = make_policy(strategy, model.num_layers, **POLICIES[strategy])
        head = DraftHead(model, vocab=vocab, int8=int8)
        out = Decoding(
            model, prompt.tolist(), policy, sampling=sampling, max_new_tokens=40, exit_head=head
        ).run()
        assert out.token_ids == ar.token_ids, (seed, settings)
        drafted += out.stats.drafted
    assert drafted > 0 or (strategy == "del-fast" and int8)  # (it finds int8 drafts too dear)
