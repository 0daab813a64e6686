"""Structured output and tool calls: the grammar through the decoding engine (every strategy
gives constrained `ar`'s tokens, greedy and sampled), `response_format` and `tools` through a
real server on loopback with the `openai` client, on the embedded SmolLM2 (`smollm2`, the
session fixture of conftest.py). Tests that need llguidance skip, saying so, without the
`grammar` extra."""

from __future__ import annotations

import copy
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch
from helpers import CHAT, TEXT, TIMEOUT, assert_error, tiny_lm
from scipy.stats import chisquare

from delspec.cli import main
from delspec.decoding.generate import encode_prompt, generate
from delspec.decoding.grammar import Constraint, grammar_available, json_grammar
from delspec.decoding.sampling import Sampler, Sampling
from delspec.errors import ConfigError
from delspec.server import create_app
from delspec.server import serving as running
from delspec.weights.loading import LoadedModel

needs_grammar = pytest.mark.skipif(
    not grammar_available(),
    reason="structured output needs llguidance: pip install 'delspec[grammar]'",
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a fictional person as JSON: name, age, city."}]
STRATEGIES = ["ar", "del-fast", "del", "dele", "static", "fs", "dv", "lookup"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def url(smollm2: LoadedModel) -> Any:
    with running(create_app(smollm2)) as base:
        yield base


@needs_grammar
def test_every_strategy_gives_constrained_ar_tokens(smollm2: LoadedModel) -> None:
    grammar = json_grammar(PERSON)
    results = {
        s: generate(smollm2, ASK_PERSON, strategy=s, grammar=grammar, max_new_tokens=80)
        for s in STRATEGIES
    }
    reference = results["ar"]
    assert reference.finish_reason == "stop"
    jsonschema.validate(json.loads(reference.text), PERSON)
    for strategy, result in results.items():
        assert result.token_ids == reference.token_ids, strategy
    free = generate(smollm2, ASK_PERSON, strategy="ar", max_new_tokens=80)
    assert free.token_ids != reference.token_ids  # the grammar did constrain the reply


@needs_grammar
def test_sampled_constrained_output_is_the_same_under_every_strategy(smollm2: LoadedModel) -> None:
    grammar = json_grammar()  # any JSON object
    runs = [
        generate(
            smollm2, ASK_PERSON, strategy=s, grammar=grammar, max_new_tokens=60,
            temperature=0.9, top_p=0.95, seed=11,
        )
        for s in ("ar", "del-fast", "static", "lookup")
    ]  # fmt: skip
    assert all(r.token_ids == runs[0].token_ids for r in runs)
    if runs[0].finish_reason == "stop":
        assert isinstance(json.loads(runs[0].text), dict)


@needs_grammar
def test_tokens_the_grammar_forces_are_drafted_for_free(smollm2: LoadedModel) -> None:
    keys = ["the_first_property_of_this_record", "and_then_the_second_property_of_it"]
    schema = {
        "type": "object",
        "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in keys},
        "required": keys,
        "additionalProperties": False,
    }
    grammar = json_grammar(schema)
    ar = generate(smollm2, ASK_PERSON, strategy="ar", grammar=grammar, max_new_tokens=60)
    static = generate(smollm2, ASK_PERSON, strategy="static", grammar=grammar, max_new_tokens=60)
    assert static.token_ids == ar.token_ids
    assert list(json.loads(ar.text)) == keys
    assert ar.stats.context_drafted == 0  # plain ar verifies no draft
    assert static.stats.context_drafted > 0 and static.stats.context_accepted > 0
    assert static.stats.rounds < ar.stats.rounds


@needs_grammar
def test_a_constraint_cuts_drafts_at_the_first_rejected_token(smollm2: LoadedModel) -> None:
    constraint = Constraint(smollm2, json_grammar(PERSON))
    good = smollm2.tokenizer.encode('{"name":"Ada","age":36,"city":"London"}')
    eos = smollm2.eos_token_ids[0]
    assert constraint.valid([*good, eos]) == len(good) + 1
    assert constraint.valid([*good[:3], eos]) == 3  # no end inside the object
    bad = smollm2.tokenizer.encode('{"name": 3}')
    assert constraint.valid(bad) < len(bad)
    constraint.push(good[:4])
    assert constraint.ahead == 4 and constraint.allowed().sum() > 0
    constraint.pop()
    assert constraint.valid(good) == len(good)  # back where it was


@needs_grammar
def test_response_format_through_the_openai_client(url: str, smollm2: LoadedModel) -> None:
    client = _client(url)
    expect = generate(
        smollm2, ASK_PERSON, strategy="ar", grammar=json_grammar(PERSON), max_new_tokens=80
    )
    spec = {"name": "person", "schema": PERSON, "strict": True}
    args: dict[str, Any] = dict(model=smollm2.name, messages=ASK_PERSON, temperature=0)
    reply = client.chat.completions.create(
        response_format={"type": "json_schema", "json_schema": spec}, max_tokens=80, **args
    )
    assert reply.choices[0].message.content == expect.text
    jsonschema.validate(json.loads(expect.text), PERSON)
    chunks = client.chat.completions.create(
        response_format={"type": "json_schema", "json_schema": spec},
        max_tokens=80, stream=True, **args,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expect.text

    class Person(pydantic.BaseModel):
        name: str
        age: int

    parsed = client.chat.completions.parse(response_format=Person, max_tokens=80, **args)
    assert isinstance(parsed.choices[0].message.parsed, Person)

    for stream in (False, True):  # the client's completions take it as an extra field
        body = {
            "model": smollm2.name, "prompt": "A person, as JSON:", "max_tokens": 100,
            "temperature": 0, "stream": stream,
            "extra_body": {"response_format": {"type": "json_schema", "json_schema": spec}},
        }  # fmt: skip
        reply = client.completions.create(**body)
        text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        jsonschema.validate(json.loads(text), PERSON)
    reply = client.chat.completions.create(
        response_format={"type": "json_object"}, max_tokens=100, **args
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")


@needs_grammar
def test_every_strategy_serves_the_same_json_at_once(url: str, smollm2: LoadedModel) -> None:
    """Requests at once share batched steps (context drafts and forced tokens as rows)."""
    spec = {"name": "person", "schema": PERSON}

    def ask(strategy: str) -> str:
        body = {
            "messages": ASK_PERSON, "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": spec},
            "delspec": {"strategy": strategy},
        }  # fmt: skip
        response = httpx.post(url + CHAT, json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, ["ar", "del-fast", "lookup", "static"]))
    assert len(set(answers)) == 1
    jsonschema.validate(json.loads(answers[0]), PERSON)


@needs_grammar
def test_bad_response_formats_are_400s_naming_the_field(url: str) -> None:
    def post(response_format: Any, path: str = CHAT) -> httpx.Response:
        body: dict[str, Any] = {"max_tokens": 4, "response_format": response_format}
        body |= {"messages": ASK_PERSON} if path == CHAT else {"prompt": "x"}
        return httpx.post(url + path, json=body, timeout=TIMEOUT)

    bad_schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "x"}}}
    error = assert_error(post(bad_schema), 400, "response_format.json_schema.schema")
    assert "type" in error["message"]
    assert_error(post(bad_schema, TEXT), 400, "response_format.json_schema.schema")
    assert_error(post({"type": "json_schema"}), 400, "response_format.json_schema")
    assert_error(post({"type": "yaml"}), 400, "response_format.type")
    no_name = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    assert_error(post(no_name), 400, "response_format.json_schema.name")


def test_without_llguidance_response_format_says_how_to_install(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import delspec.decoding.grammar as grammar

    def missing() -> Any:
        raise grammar.MissingGrammarEngine(
            f"structured output needs llguidance, which is not installed: {grammar.INSTALL_HINT}"
        )

    monkeypatch.setattr(grammar, "_llguidance", missing)
    body = {"messages": ASK_PERSON, "max_tokens": 4, "response_format": {"type": "json_object"}}
    error = assert_error(httpx.post(url + CHAT, json=body, timeout=TIMEOUT), 400, "response_format")
    assert "pip install 'delspec[grammar]'" in error["message"]


@needs_grammar
def test_a_tool_call_round_trip(url: str, smollm2: LoadedModel) -> None:
    client = _client(url)
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    args: dict[str, Any] = dict(model=smollm2.name, temperature=0, max_tokens=60)
    reply = client.chat.completions.create(
        messages=ask, tools=[WEATHER, TIME], tool_choice="required", **args
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    schema = {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}
    jsonschema.validate(
        json.loads(call.function.arguments), schema[call.function.name]["function"]["parameters"]
    )
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "c": 21}'}
    turn = [*ask, choice.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(messages=turn, tools=[WEATHER], **args)
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")

    chunks = list(
        client.chat.completions.create(
            messages=ask, tools=[WEATHER, TIME], tool_choice="required", stream=True, **args
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@needs_grammar
def test_a_named_tool_choice_forces_a_valid_call(url: str, smollm2: LoadedModel) -> None:
    client = _client(url)
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    reply = client.chat.completions.create(
        model=smollm2.name, messages=ask, tools=[WEATHER, TIME], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
    body = {"messages": ask, "max_tokens": 4, "tools": [bad], "tool_choice": "required"}
    error = assert_error(httpx.post(url + CHAT, json=body, timeout=TIMEOUT), 400, "tools")
    assert "parameters" in error["message"]


def test_bad_tool_requests_are_400s_naming_the_field(url: str) -> None:
    def post(extra: dict[str, Any], path: str = CHAT) -> httpx.Response:
        body: dict[str, Any] = {"messages": ASK_PERSON} if path == CHAT else {"prompt": "x"}
        body |= {"max_tokens": 4, **extra}
        return httpx.post(url + path, json=body, timeout=TIMEOUT)

    named = {"type": "function", "function": {"name": "nope"}}
    assert_error(post({"tools": [WEATHER], "tool_choice": named}), 400, "tool_choice.function.name")
    assert_error(post({"tool_choice": "required"}), 400, "tool_choice")
    nameless = {"type": "function", "function": {"parameters": {}}}
    assert_error(post({"tools": [nameless]}), 400, "tools[0].function.name")
    assert_error(post({"tools": [WEATHER, WEATHER]}), 400, "tools")
    assert_error(post({"tools": [WEATHER]}, TEXT), 400, "tools")
    orphan = [*ASK_PERSON, {"role": "tool", "content": "21 C"}]
    assert_error(post({"messages": orphan}), 400, "messages[1]")


TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}{% for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@needs_grammar
def test_a_template_that_takes_tools_renders_them(smollm2: LoadedModel) -> None:
    """A tiny random model whose chat template takes tools (Qwen2-style tags): the prompt
    holds the tools and the earlier call, and a required call is valid JSON of its schema."""
    lm = tiny_lm(smollm2)
    lm.tokenizer = copy.deepcopy(smollm2.tokenizer)
    lm.tokenizer.chat_template = TOOLS_TEMPLATE
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}  # fmt: skip
    turn = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    with running(create_app(lm)) as base:
        client = _client(base)
        reply = client.chat.completions.create(
            model=lm.name, messages=turn, tools=[TIME], tool_choice="required", temperature=0,
            max_tokens=40,
        )  # fmt: skip
    [made] = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(made.function.arguments), TIME["function"]["parameters"])
    from delspec.server.openai_types import Tool
    from delspec.server.protocol import ChatMessage
    from delspec.server.structured import conversation

    messages, specs = conversation([ChatMessage(**m) for m in turn], [Tool(**TIME)], True)
    text = lm.tokenizer.decode(encode_prompt(lm, messages, tools=specs))
    assert json.dumps(TIME) in text or '"get_time"' in text.split("<tools>")[1]
    assert '"arguments": {"zone": "UTC"}' in text and "<tool_response>\n12:00" in text


def test_a_template_that_refuses_the_conversation_is_a_config_error(smollm2: LoadedModel) -> None:
    lm = tiny_lm(smollm2)
    lm.tokenizer = copy.deepcopy(smollm2.tokenizer)
    lm.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ConfigError, match="roles must alternate"):
        encode_prompt(lm, ASK_PERSON)


@needs_grammar
def test_generate_json_schema_from_the_command_line(
    smollm2: LoadedModel, tmp_path: Any, capsys: pytest.CaptureFixture
) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    prompt = ASK_PERSON[0]["content"]
    argv = ["generate", prompt, "--chat", "--json", "--max-new-tokens", "80"]
    assert main([*argv, "--json-schema", str(schema)]) == 0
    out = json.loads(capsys.readouterr().out)
    expect = generate(smollm2, ASK_PERSON, grammar=json_grammar(PERSON), max_new_tokens=80)
    assert out["token_ids"] == expect.token_ids
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert main([*argv, "--json-object"]) == 0
    assert isinstance(json.loads(json.loads(capsys.readouterr().out)["text"]), dict)
    for content, message in [("{bad", "is not JSON"), ('{"type": "x"}', "is not supported")]:
        schema.write_text(content)
        assert main([*argv, "--json-schema", str(schema)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"delspec: error: --json-schema {schema}") and message in err


@pytest.mark.parametrize(
    "options", [{}, {"top_p": 0.8}, {"top_k": 5, "min_p": 0.05}, {"frequency_penalty": 1.0}]
)
def test_masked_draws_follow_the_masked_distribution(options: dict[str, Any]) -> None:
    """What the engine does to a row under a grammar (disallowed logits at -inf), drawn by
    `Sampler`: never a masked token, and the frequencies of the processed distribution over
    the allowed tokens (chi-square, significance 0.001)."""
    vocab, samples = 40, 3000
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(vocab, generator=generator, dtype=torch.float64) * 2
    allowed = np.zeros(vocab, dtype=bool)
    allowed[::3] = True
    row = logits.numpy().copy()
    row[~allowed] = -np.inf
    sampling = Sampling(0.9, seed=7, **options)
    sampler = Sampler(sampling, vocab, prompt=[1, 2])
    before = [3, 3] if options.get("frequency_penalty") else []
    counts = Counter(sampler.draw(row, p, before, confidence=False)[0] for p in range(samples))
    assert set(counts) <= set(np.flatnonzero(allowed).tolist())
    masked = torch.from_numpy(row)
    expected = sampling.probs(masked, [1, 2], before).numpy()
    support = np.flatnonzero(expected > 0)
    observed = [counts.get(int(t), 0) for t in support]
    assert sum(observed) == samples
    assert chisquare(observed, expected[support] * samples).pvalue > 0.001


def test_replies_are_read_for_tool_calls() -> None:
    from delspec.server.openai_types import Tool
    from delspec.server.structured import CallFilter, parse_calls

    tools = [Tool(**WEATHER), Tool(**TIME)]
    text = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text += '</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    content, calls = parse_calls(text, tools, forced=False)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["id"].startswith("call_") and content.startswith("Let me look.")
    assert parse_calls("No call here.", tools, forced=False) == ("No call here.", [])
    unclosed = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert parse_calls(unclosed, tools, forced=False)[1][0]["function"]["name"] == "get_time"
    forced = parse_calls('{"name":"get_time","arguments":{"zone":"JST"}}', tools, forced=True)
    assert forced[0] is None and forced[1][0]["function"]["arguments"] == '{"zone": "JST"}'

    held = CallFilter(forced=False)
    pieces = [held.push(p) for p in ["Let me ", "look. <tool", "_call>{", '"name": "get_time", ']]
    pieces.append(held.push('"arguments": {"zone": "CET"}}</tool_call>'))
    assert "".join(pieces) == "Let me look. "
    rest, calls = held.finish(tools)
    assert rest == "" and calls[0]["function"]["name"] == "get_time"
    plain = CallFilter(forced=False)
    assert plain.push("a <tool") == "a " and plain.push(" box") == "<tool box"
    assert plain.finish(tools) == ("", [])


@needs_grammar
def test_a_draft_vocabulary_the_grammar_allows_nothing_of_stops_drafting(
    smollm2: LoadedModel,
) -> None:
    """Drafts from a pruned vocabulary without a token the grammar allows end before their
    first token (the pass that found none is not kept); the tokens stay constrained ar's."""
    from helpers import AtLevel

    from delspec.decoding.sequence import Decoding
    from delspec.drafting.draft_head import DraftHead
    from delspec.drafting.exit_head import ExitHead
    from delspec.policies import make_policy

    lm = tiny_lm(smollm2)
    grammar = json_grammar(PERSON)
    prompt = encode_prompt(lm, ASK_PERSON)

    def tokens(policy: Any, head: ExitHead | None = None) -> list[int]:
        decoding = Decoding(
            lm.model, prompt, policy, max_new_tokens=30, eos_token_ids=lm.eos_token_ids,
            exit_head=head, constraint=Constraint(lm, grammar),
        )  # fmt: skip
        decoding.start()
        while not decoding.done:
            decoding.advance()
        return decoding.finish().token_ids

    # word pieces, none of which can open the JSON; the largest level is the whole vocabulary
    pieces = torch.arange(1000, 1100)
    head = DraftHead(lm.model, vocab=[pieces, None], context_vocab=False)
    layers = lm.model.num_layers
    expect = tokens(make_policy("ar", layers))
    for level in (0, 1):
        assert tokens(AtLevel(layers, level, exit_layer=2, draft_length=3), head) == expect
