"""The light tokenizer a GGUF file's cache entry keeps (`weights.tokenizer`): on the named
models it encodes, decodes and renders chat templates exactly as transformers' tokenizer of the
same entry does, without building that tokenizer; what it leaves to transformers' tokenizer
answers as that tokenizer does; and a later load of a cached model, generation included, never
imports transformers."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import textwrap

import jinja2
import pytest

from delspec.weights.gguf_file import GGUFFile
from delspec.weights.named_models import NAMED_MODELS, named_model_path
from delspec.weights.tokenizer import LightTokenizer, load_tokenizer, transformers_tokenizer

pytestmark = pytest.mark.slow

MODELS = ["smollm2", "gemma3-270m"]
TEXTS = [
    "",
    "The capital of France is",
    " leading space, trailing space ",
    "  two\tspaces,\ttabs\nand\n\nnewlines\r\n   \n",
    "Été 東京 😀 naïve café — ½ ∑ ñ ü",
    "e\u0301 combining, zero\u200bwidth, nbsp\u00a0here, bom\ufeff",
    "emoji with skin tone 👍🏽 and family 👨‍👩‍👧 and flag 🇫🇷",
    "def add(a, b):\n    return a + b  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<eos><pad><unk>",
    "<|endoftext|> in the middle <|im_end|>of text",
    "1234567890 3.14159 1e-9 0x1F",
    "a" * 300 + " " + "ab" * 150,
    "混合 English と日本語 и русский и العربية",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about rain."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Été 東京 😀\n  spaced  "},
    ],
    [{"role": "user", "content": "<|im_start|>not a turn<|im_end|>"}],
]
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
# a template that takes tools and every construct transformers' environment provides
TOOLS_TEMPLATE = """{%- set ns = namespace(system=none, calls=0) -%}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif -%}
{{ bos_token }}{% if tools %}<|im_start|>system
{{ ns.system or 'You may call functions.' }}
<tools>
{% for tool in tools %}{{ tool | tojson }}
{{ tool.function | tojson(indent=2, sort_keys=true) }}
{% endfor %}</tools><|im_end|>
{% elif ns.system %}<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
    {% else %}<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.thinking }}</think>{% endif %}
{%- generation %}{{ message.content if message.content is defined else '' }}{% endgeneration %}
{%- for call in message.tool_calls or [] %}{% set ns.calls = ns.calls + 1 %}<tool_call>
{{ dict(name=call.function.name, arguments=call.function.arguments) | tojson }}
</tool_call>{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}"""
TOOL_CHATS = [
    [{"role": "user", "content": "Time?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time in UTC?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "The user wants the time.",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_time", "arguments": {"zone": "UTC"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ],
]  # fmt: skip


def installed(name: str) -> bool:
    return importlib.util.find_spec(NAMED_MODELS[name].package) is not None


@pytest.fixture(scope="module", params=MODELS)
def tokenizers(request: pytest.FixtureRequest) -> tuple[LightTokenizer, object]:
    """A named model's light tokenizer and transformers' tokenizer, of the same cache entry."""
    if not installed(request.param):
        pytest.skip(f"{request.param} is not installed: {NAMED_MODELS[request.param].install}")
    entry = GGUFFile(named_model_path(request.param)).directory
    light = load_tokenizer(entry, cache_entry=True)
    assert isinstance(light, LightTokenizer)
    return light, transformers_tokenizer(entry)


def test_encoding_and_decoding_are_transformers_own(tokenizers):
    light, full = tokenizers
    for text in TEXTS:
        for special in (True, False):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == full.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip
            )
        # growing prefixes, as streaming decodes them (cut characters included)
        for end in range(min(len(ids), 40)):
            assert light.decode(ids[:end]) == full.decode(ids[:end])
        assert light.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
        assert light.convert_tokens_to_ids(light.convert_ids_to_tokens(ids)) == ids
    assert light.decode(2) == full.decode(2)
    assert light.convert_ids_to_tokens(3) == full.convert_ids_to_tokens(3)
    assert light.convert_tokens_to_ids("no such token ✗") == full.convert_tokens_to_ids(
        "no such token ✗"
    )
    assert light._full is None  # all of it without transformers' tokenizer


def test_vocabulary_and_special_tokens_are_transformers_own(tokenizers):
    light, full = tokenizers
    assert light.get_vocab() == full.get_vocab()
    assert (len(light), light.vocab_size) == (len(full), full.vocab_size)
    assert light.special_tokens_map == full.special_tokens_map
    for name in full.SPECIAL_TOKENS_ATTRIBUTES:
        assert getattr(light, name) == getattr(full, name), name
        assert getattr(light, f"{name}_id") == getattr(full, f"{name}_id"), name
    assert light.chat_template == full.chat_template
    assert light._full is None


def render_both(light, full, chat, **options) -> str:
    """The chat as both render it (transformers with the light one's template)."""
    full.chat_template = light.chat_template
    ours = light.apply_chat_template(chat, tokenize=False, **options)
    assert ours == full.apply_chat_template(chat, tokenize=False, **options)
    return ours


def test_chat_templates_render_as_transformers_renders_them(tokenizers):
    light, full = tokenizers
    light = copy.deepcopy(light)
    full = copy.deepcopy(full)
    if light.chat_template is None:  # Gemma-3-270M's file has none: SmolLM2's
        light.chat_template = transformers_tokenizer(
            GGUFFile(named_model_path("smollm2")).directory
        ).chat_template
    for chat in CHATS:
        for prompt in (True, False):
            render_both(light, full, chat, add_generation_prompt=prompt)
    light.chat_template = TOOLS_TEMPLATE
    for chat in TOOL_CHATS:
        for prompt in (True, False):
            text = render_both(light, full, chat, tools=[TIME_TOOL], add_generation_prompt=prompt)
            assert '"get_time"' in text
        render_both(light, full, chat, add_generation_prompt=True, enable_thinking=False)
        render_both(light, full, chat, documents=[{"title": "T", "text": "body"}])
        render_both(light, full, chat, tools=[], chat_template=TOOLS_TEMPLATE + "!")
    assert light._full is None  # rendered here, not by transformers


def test_what_the_light_tokenizer_leaves_to_transformers_answers_the_same(tokenizers):
    light, full = tokenizers
    light = copy.deepcopy(light)
    text = TEXTS[4]
    assert light(text)["input_ids"] == full(text)["input_ids"]
    assert light.all_special_ids == full.all_special_ids and light.is_fast
    ids = light.encode(text)
    assert light.decode([ids]) == full.decode([ids])  # a batch
    assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == (
        full.convert_ids_to_tokens(ids, skip_special_tokens=True)
    )
    light.chat_template = "{{ raise_exception('roles must alternate') }}"
    chat = CHATS[0]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        light.apply_chat_template(chat, tokenize=False)
    light.chat_template = TOOLS_TEMPLATE  # tokens: transformers' tokenizer, with this template
    full.chat_template = TOOLS_TEMPLATE
    assert light.apply_chat_template(chat, tools=[TIME_TOOL]) == full.apply_chat_template(
        chat, tools=[TIME_TOOL]
    )
    assert light.transformers_tokenizer.chat_template == TOOLS_TEMPLATE
    assert tokenizers[0]._full is None and tokenizers[0].chat_template != TOOLS_TEMPLATE


LATER_LOAD = """
    import sys
    import delspec
    lm = delspec.load_model({name!r})
    assert type(lm.tokenizer).__name__ == "LightTokenizer", type(lm.tokenizer)
    prompt = [{{"role": "user", "content": "Hi"}}] if lm.tokenizer.chat_template else "Hi"
    result = delspec.generate(lm, prompt, max_new_tokens=4)
    lm.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""


@pytest.mark.parametrize("name", MODELS)
def test_a_later_load_and_generation_never_import_transformers(name):
    """A model whose cache entry exists loads and generates (native weights, its chat template)
    without importing transformers."""
    if not installed(name):
        pytest.skip(f"{name} is not installed: {NAMED_MODELS[name].install}")
    GGUFFile(named_model_path(name))  # the entry, made here where it is missing
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = textwrap.dedent(LATER_LOAD.format(name=name))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
