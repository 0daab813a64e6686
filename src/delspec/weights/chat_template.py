"""Chat templates rendered exactly as transformers' `apply_chat_template(..., tokenize=False)`
renders them, without importing transformers.

The same environment (`transformers.utils.chat_template_utils`): jinja2's immutable sandbox with
trim_blocks and lstrip_blocks, loop controls and the `{% generation %}` block (rendered as its
body, as transformers does when it tracks no assistant tokens), `tojson` without HTML escaping,
the globals `raise_exception`, `strftime_now`, `dict` and `namespace` (no underscore names). The
same inputs: messages without their None-valued keys, the reasoning of a message under each name
templates read it by, the tokenizer's special tokens as variables under the caller's. Only plain
JSON data (dicts with string keys, lists, tuples, strings, numbers, booleans, None) is rendered
here: `render_chat` returns None for anything else, which the caller leaves to transformers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning is passed under; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PLAIN_SCALARS = (str, int, float, bool, type(None))
# transformers refuses to render chat templates with older jinja2 (known sandbox escapes)
_OLDEST_JINJA = (3, 1, 6)


class _NotPlain(Exception):
    """A value that is not plain JSON data."""


def render_chat(
    template: str,
    conversation: Any,
    tools: Any,
    documents: Any,
    add_generation_prompt: Any,
    variables: Mapping[str, Any],
) -> str | None:
    """`template` rendered for one conversation (a list of message dicts), its `tools` and
    `documents` (lists of dicts, or None) and template `variables`, as transformers renders it;
    None when transformers would do more than render (a batch, an empty conversation, callables
    as tools, data that is not plain JSON) or refuse (an old jinja2)."""
    if not _jinja_is_recent() or not isinstance(conversation, list | tuple) or not conversation:
        return None
    try:
        messages = _plain(conversation)
        tool_list = None if tools is None else [_plain(tool) for tool in tools]
        docs = None if documents is None else _plain(documents)
        extra = _plain(dict(variables))
    except (_NotPlain, TypeError):
        return None
    if not all(isinstance(m, dict) for m in messages) or not all(
        isinstance(t, dict) for t in tool_list or []
    ):
        return None
    if docs is not None and not all(isinstance(d, dict) for d in docs):
        return None
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compiled(template).render(
        messages=[_alias_reasoning(m) for m in messages],
        tools=tool_list,
        documents=docs,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )


def _plain(value: Any) -> Any:
    """A copy of plain JSON data `value` (tuples stay tuples); `_NotPlain` for anything else."""
    if type(value) in _PLAIN_SCALARS:
        return value
    if type(value) is dict:
        if not all(type(key) is str for key in value):
            raise _NotPlain
        return {key: _plain(item) for key, item in value.items()}
    if type(value) is list:
        return [_plain(item) for item in value]
    if type(value) is tuple:
        return tuple(_plain(item) for item in value)
    raise _NotPlain


def _alias_reasoning(message: dict) -> dict:
    """`message` with its reasoning (under any of `REASONING_FIELDS`) also as `thinking` and
    `reasoning_content`."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _jinja_is_recent() -> bool:
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", jinja2.__version__)
    return found is not None and tuple(map(int, found.groups())) >= _OLDEST_JINJA


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict` in templates: makes dicts, and offers no attribute beyond `fromkeys`."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` in templates, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(template)
