"""The draft pool: context drafts from earlier replies. Its lookup and bound on real token lists
(SmolLM2's tokenizer), the library (`generate(draft_pool=...)`: a repeated question drafts from
the first answer and gives `ar`'s tokens, greedy and sampled), del-fast's separate statistics per
source, and the server through the `openai` client (pool drafts counted in /metrics, answers
equal to `ar`'s, the flag turning it off, bad values refused naming the field)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from helpers import TIMEOUT, tiny_lm

import delspec
from delspec.decoding.generate import encode_prompt
from delspec.decoding.grammar import grammar_available, json_grammar
from delspec.drafting.context_drafts import POOL, SEQUENCE
from delspec.drafting.draft_pool import LEAD_IN, DraftPool
from delspec.errors import ConfigError
from delspec.machine.cost_profile import QUICK_PROFILE_STEPS
from delspec.policies.fast_state import ContextScore
from delspec.server import create_app
from delspec.server import serving as running
from delspec.weights.loading import LoadedModel

QUESTION = [{"role": "user", "content": "List the planets of the solar system, one per line."}]
OTHER = "Explain in two sentences why the sky is blue."


def words(lm: LoadedModel, text: str) -> list[int]:
    return lm.tokenizer.encode(text)


def test_the_pool_proposes_what_followed_an_earlier_reply(smollm2: LoadedModel) -> None:
    prompt = words(smollm2, "Name a fruit and its colour.")
    reply = words(smollm2, " The banana is a yellow fruit that grows in bunches on tall plants.")
    pool = DraftPool(1000)
    pool.add(prompt, reply)
    cut = 6  # a new sequence that reached the reply's first `cut` tokens
    proposal = pool.propose([*words(smollm2, "Tell me:"), *reply[:cut]], 5)
    assert proposal.tokens == reply[cut : cut + 5] and proposal.source == POOL
    assert proposal.match_length == cut  # the match reaches back over the reply's tokens
    # from the prompt's end (the lead-in) to the reply's first tokens
    assert pool.propose(prompt[-3:], 4).tokens == reply[:4]
    # never past the end of the reply it found
    assert pool.propose(reply[:-2], 10).tokens == reply[-2:]
    # nothing shared: nothing proposed
    assert not pool.propose(words(smollm2, "Quantum chromodynamics"), 4).tokens


def test_the_latest_reply_wins_and_replies_do_not_run_together(smollm2: LoadedModel) -> None:
    old = words(smollm2, " Answer: the total is 42 apples.")
    new = words(smollm2, " Answer: the total is 17 pears.")
    pool = DraftPool(1000)
    pool.add([], old)
    pool.add([], new)
    at = new.index(words(smollm2, " is")[0]) + 1
    assert pool.propose(new[:at], 3).tokens == new[at : at + 3]
    # the last tokens of one reply do not lead into the next
    assert pool.propose(old, 4).tokens == []


def test_the_pool_forgets_the_oldest_replies_past_its_bound(smollm2: LoadedModel) -> None:
    texts = [f" Report {i}: the sensor in room {i} read {10 * i} degrees today." for i in range(8)]
    replies = [words(smollm2, text) for text in texts]
    bound = 3 * len(replies[0]) + 5
    pool = DraftPool(bound)
    for reply in replies:
        pool.add([], reply)
        assert len(pool) <= bound
    kept = [r for r in replies if pool.propose(r[:4], len(r)).tokens == r[4:]]
    assert replies[-1] in kept and replies[0] not in kept
    # what the index holds points only at tokens kept
    for table in pool.follows.values():
        assert all(pool.base <= at < pool.base + len(pool) for at in table.values())
    # a reply longer than the bound keeps its newest tokens
    long = [t for r in replies for t in r]
    pool.add([], long)
    assert len(pool) == bound and pool.tokens == long[-bound:]


def test_a_reply_is_led_in_by_the_end_of_its_prompt(smollm2: LoadedModel) -> None:
    prompt = words(smollm2, "word " * (3 * LEAD_IN))
    pool = DraftPool(1000)
    pool.add(prompt, [7, 8, 9])
    assert pool.tokens == [*prompt[-LEAD_IN:], 7, 8, 9]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_a_bad_bound_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_tokens must be an integer >= 1"):
        DraftPool(bad)


def test_pool_proposals_have_statistics_of_their_own() -> None:
    score = ContextScore(0.98, 3.0)
    for _ in range(10):
        score.count([(4, [True, True, True, False])], POOL)
        score.count([(4, [False])], SEQUENCE)
    pool_first, _ = score.acceptance(4, POOL)
    own_first, _ = score.acceptance(4, SEQUENCE)
    assert pool_first > 0.6 and own_first < 0.2  # (the priors pull both towards misses)


# The library.


@pytest.fixture(scope="module")
def measured(smollm2: LoadedModel) -> LoadedModel:
    """SmolLM2 with this machine's decode costs measured: `del-fast` prices context drafts,
    pool drafts among them, with them, and a machine that has none stored yet measures them
    at the first run long enough to repay it (`MachineProfile.cost_profile`)."""
    delspec.generate(smollm2, "Count to forty:", max_new_tokens=QUICK_PROFILE_STEPS)
    return smollm2


@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "del-fast"},
        {"strategy": "lookup"},
        {"strategy": "del-fast", "temperature": 0.7, "top_p": 0.9, "seed": 5},
    ],
    ids=str,
)
def test_a_repeated_question_drafts_from_the_pool_and_answers_as_ar(
    measured: LoadedModel, options: dict[str, Any]
) -> None:
    smollm2 = measured
    pool = DraftPool(4096)
    ar = delspec.generate(smollm2, QUESTION, max_new_tokens=48, **{**options, "strategy": "ar"})
    first = delspec.generate(smollm2, QUESTION, max_new_tokens=48, draft_pool=pool, **options)
    assert first.token_ids == ar.token_ids
    assert len(pool) == min(LEAD_IN, first.stats.prompt_tokens) + len(first.token_ids)
    again = delspec.generate(smollm2, QUESTION, max_new_tokens=48, draft_pool=pool, **options)
    assert again.token_ids == ar.token_ids
    assert again.stats.pool_drafted > 0 and again.stats.pool_accepted > 0
    assert again.stats.pool_accepted <= again.stats.context_accepted
    # without the pool, no pool drafts
    alone = delspec.generate(smollm2, QUESTION, max_new_tokens=48, **options)
    assert alone.token_ids == ar.token_ids and alone.stats.pool_drafted == 0


@pytest.mark.skipif(not grammar_available(), reason="structured output needs llguidance")
@pytest.mark.parametrize("strategy", ["del-fast", "lookup"])
def test_pool_drafts_under_a_grammar_give_constrained_ar_tokens(
    measured: LoadedModel, strategy: str
) -> None:
    """Pool drafts are cut at the first token the grammar rejects, like any context draft: a
    repeated structured request drafts from the first reply and gives constrained `ar`'s."""
    smollm2 = measured
    grammar = json_grammar()
    ask = [{"role": "user", "content": "Describe a cat as a JSON object with name and age."}]
    ar = delspec.generate(smollm2, ask, max_new_tokens=40, strategy="ar", grammar=grammar)
    pool = DraftPool(4096)
    for _ in range(2):
        result = delspec.generate(
            smollm2, ask, max_new_tokens=40, strategy=strategy, grammar=grammar, draft_pool=pool
        )
        assert result.token_ids == ar.token_ids
    assert result.stats.pool_accepted > 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_wrong_pool_drafts_are_rejected_and_the_answer_is_ars(
    smollm2: LoadedModel, sampled: bool
) -> None:
    """A pool whose stored reply to the very same prompt is another text: `lookup` drafts it
    (it drafts whatever is proposed), the verifier rejects it, and the tokens are `ar`'s."""
    options: dict[str, Any] = {"temperature": 0.8, "seed": 11} if sampled else {}
    ar = delspec.generate(smollm2, QUESTION, max_new_tokens=32, strategy="ar", **options)
    pool = DraftPool(4096)
    wrong = words(smollm2, "Sure! Here are some facts about volcanoes and lava flows instead.")
    pool.add(encode_prompt(smollm2, QUESTION, False), wrong)
    result = delspec.generate(
        smollm2, QUESTION, max_new_tokens=32, strategy="lookup", draft_pool=pool, **options
    )
    assert result.token_ids == ar.token_ids
    assert result.stats.pool_drafted > result.stats.pool_accepted


def test_ar_fills_the_pool_but_never_drafts_from_it(measured: LoadedModel) -> None:
    smollm2 = measured
    pool = DraftPool(4096)
    for _ in range(2):
        result = delspec.generate(
            smollm2, QUESTION, max_new_tokens=16, draft_pool=pool, strategy="ar"
        )
        assert result.stats.pool_drafted == result.stats.drafted == 0
    assert len(pool) == 2 * (min(LEAD_IN, result.stats.prompt_tokens) + 16)
    again = delspec.generate(smollm2, QUESTION, max_new_tokens=16, draft_pool=pool)
    assert again.token_ids == result.token_ids and again.stats.pool_drafted > 0


def test_a_session_drafts_from_its_pool(measured: LoadedModel) -> None:
    smollm2 = measured
    ar = delspec.generate(smollm2, QUESTION, max_new_tokens=32, strategy="ar")
    session = delspec.Session(smollm2, draft_pool=DraftPool(4096))
    first = session.generate(QUESTION, max_new_tokens=32)
    again = session.generate(QUESTION, max_new_tokens=32)
    assert first.token_ids == again.token_ids == ar.token_ids
    assert again.stats.pool_drafted > 0 and len(session.draft_pool or ()) > 0


# The server, through the openai client.


def samples(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[0] != "#")
    }


@pytest.fixture(scope="module")
def pooled_url(smollm2: LoadedModel) -> Iterator[str]:
    with running(create_app(smollm2, max_batch=2, draft_pool_tokens=2048)) as url:
        yield url


def ask(url: str, lm: LoadedModel, messages: list[dict[str, str]], **delspec_options: Any) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT)
    reply = client.chat.completions.create(
        model=lm.name,
        messages=messages,
        temperature=0,
        max_tokens=48,
        extra_body={"delspec": delspec_options},
    )
    return reply.choices[0].message.content or ""


def test_the_server_drafts_a_repeated_answer_from_the_pool(
    pooled_url: str, smollm2: LoadedModel
) -> None:
    ar = ask(pooled_url, smollm2, QUESTION, strategy="ar")
    before = samples(pooled_url)
    assert ask(pooled_url, smollm2, QUESTION) == ar  # del-fast, the default; the pool holds it
    after = samples(pooled_url)
    drafted = after["delspec_pool_draft_tokens_total"] - before["delspec_pool_draft_tokens_total"]
    accepted = (
        after["delspec_pool_accepted_draft_tokens_total"]
        - before["delspec_pool_accepted_draft_tokens_total"]
    )
    assert drafted > 0 and 0 < accepted <= drafted
    # a different question still answers as ar does
    other = [{"role": "user", "content": OTHER}]
    assert ask(pooled_url, smollm2, other) == ask(pooled_url, smollm2, other, strategy="ar")


def test_batched_requests_share_the_pool_and_answer_as_ar(
    pooled_url: str, smollm2: LoadedModel
) -> None:
    """Requests that run together (batched steps: their context drafts, from the pool too, are
    rows of the shared pass where the step's cost pays for them) still give `ar`'s answers."""
    questions = [[{"role": "user", "content": f"Spell the word {w}, one letter per line."}]
                 for w in ("planet", "garden")]  # fmt: skip
    ar = [ask(pooled_url, smollm2, q, strategy="ar") for q in questions]
    before = samples(pooled_url)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda q: ask(pooled_url, smollm2, q), questions * 2))
    assert replies == ar * 2
    after = samples(pooled_url)
    requests, steps = (
        after[k] - before[k] for k in ("delspec_batch_size_sum", "delspec_batch_size_count")
    )
    assert requests > steps  # some step ran more than one request
    drafted, accepted = (
        after[k] - before[k]
        for k in ("delspec_pool_draft_tokens_total", "delspec_pool_accepted_draft_tokens_total")
    )
    assert 0 <= accepted <= drafted


def test_the_servers_pool_keeps_its_bound(smollm2: LoadedModel) -> None:
    bound = 150
    with running(create_app(smollm2, max_batch=2, draft_pool_tokens=bound)) as url:
        held = []
        for i in range(4):
            ask(url, smollm2, [{"role": "user", "content": f"Count from {i} to {i + 30}."}])
            held.append(samples(url)["delspec_draft_pool_tokens"])
    assert held[0] > 0 and all(0 < tokens <= bound for tokens in held)
    assert held[0] < bound  # one reply of 48 tokens and its lead-in: the bound not reached


def test_a_server_without_a_pool_drafts_nothing_from_it(smollm2: LoadedModel) -> None:
    with running(create_app(smollm2, max_batch=1, draft_pool_tokens=0)) as url:
        ar = ask(url, smollm2, QUESTION, strategy="ar")
        for _ in range(2):
            assert ask(url, smollm2, QUESTION) == ar
        assert samples(url)["delspec_pool_draft_tokens_total"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "many", True])
def test_a_bad_pool_size_is_refused(smollm2: LoadedModel, bad: Any) -> None:
    with pytest.raises(ConfigError, match="draft_pool_tokens must be an integer >= 0"):
        create_app(tiny_lm(smollm2), draft_pool_tokens=bad)
