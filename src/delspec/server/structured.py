"""Structured output and tool calls in the OpenAI API: `response_format` and `tools` /
`tool_choice` into a grammar and a prompt, and a reply's text into `tool_calls`.

Tools reach the model through its chat template when the template takes them (it names
`tools`: transformers' `apply_chat_template(tools=...)`), else through a generic system text
(`GENERIC_TOOLS`) that asks for the Hermes form `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`; earlier calls and `tool` results are rendered the same way for such a
template (results as a user turn in `<tool_response>` tags, as Qwen2's template does).
`tool_choice` "auto" parses the reply for such calls; "required" and a named function
constrain the reply to the JSON of one call (`{"name": ..., "arguments": ...}`, the
arguments matching the function's parameter schema); "none" renders no tools.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from delspec.decoding.grammar import Grammar, check_grammar, json_grammar
from delspec.errors import ConfigError
from delspec.server.openai_types import NamedToolChoice, ResponseFormat, Tool, ToolChoice
from delspec.server.protocol import APIError

GENERIC_TOOLS = (
    "You may call functions to help answer. These are their JSON descriptions:\n{tools}\n"
    'To call one, answer only with <tool_call>{{"name": <its name>, "arguments": '
    "<an object of its parameters>}}</tool_call>; the result comes back in "
    "<tool_response></tool_response> tags. Otherwise answer the user directly."
)
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_CALL_CLOSE) + "|$)", re.S)


def format_grammar(lm: Any, response_format: ResponseFormat | None) -> Grammar | None:
    """The grammar `response_format` asks for (None: free text); a 400 naming the field for
    a schema llguidance refuses, or when llguidance is not installed."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _checked(lm, None, "response_format", "response_format")
    spec = response_format.json_schema
    if spec is None:
        raise APIError(
            400,
            "response_format of type json_schema needs a json_schema object",
            param="response_format.json_schema",
        )
    param = "response_format.json_schema.schema"
    return _checked(lm, spec.schema_ or {"type": "object"}, param, param)


def tool_grammar(lm: Any, tools: list[Tool], choice: ToolChoice) -> Grammar | None:
    """The grammar of the one call `choice` requires ("required": any of `tools`; a named
    function: that one), or None."""
    if not isinstance(choice, NamedToolChoice) and choice != "required":
        return None
    functions = [t.function for t in tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return _checked(lm, schema, "tools", "the tools' parameters")


def _checked(lm: Any, schema: dict[str, Any] | None, param: str, name: str) -> Grammar:
    try:
        grammar = json_grammar(schema, name)
        check_grammar(lm, grammar)
    except ConfigError as exc:
        raise APIError(400, str(exc), param=param) from None
    return grammar


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """The effective tool choice ("none" without tools, "auto" by default); 400 for a choice
    that names no given tool, or tools given twice under one name."""
    names = [t.function.name for t in tools or []]
    seen = {n for i, n in enumerate(names) if n in names[:i]}
    if seen:
        raise APIError(400, f"tools name function {sorted(seen)[0]!r} twice", param="tools")
    if choice is None:
        return "auto" if names else "none"
    if choice != "none" and not names:
        raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names function {choice.function.name!r}, which is not in tools",
            param="tool_choice.function.name",
        )
    return choice


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return isinstance(template, str) and "tools" in template


def conversation(
    messages: list[Any], tools: list[Tool] | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render: for a template that takes tools (`native`), the
    OpenAI messages as transformers expects them (call arguments as objects); else tools and
    calls as text (the module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.content or ""
        calls = [
            (c.id, c.function.name, _arguments(c.function.arguments)) for c in message.tool_calls
        ]
        if native:
            entry: dict[str, Any] = {"role": message.role, "content": content}
            if calls:
                entry["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                    for i, n, a in calls
                ]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            out.append(entry)
        elif message.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            text = [content] if content else []
            text += [
                _CALL_OPEN + json.dumps({"name": n, "arguments": a}) + _CALL_CLOSE
                for _, n, a in calls
            ]
            out.append({"role": message.role, "content": "\n".join(text)})
    if not tools:
        return out, None
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if native:
        return out, specs
    described = "\n".join(json.dumps(s["function"]) for s in specs)
    text = GENERIC_TOOLS.format(tools=described)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def _arguments(text: str) -> Any:
    """A call's `arguments` JSON text as a value (left as text when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_calls(text: str, tools: list[Tool], forced: bool) -> tuple[str | None, list[dict]]:
    """The reply's content and its tool calls (OpenAI's objects): with `forced`, the whole text
    is one call's JSON; else the `<tool_call>` blocks that hold a call of a given tool."""
    names = {t.function.name for t in tools}
    if forced:
        call = _call(text, names)
        return (None, [call]) if call else (text, [])
    calls, content = [], text
    for match in _CALL.finditer(text):
        call = _call(match.group(1), names)
        if call is not None:
            calls.append(call)
            content = content.replace(match.group(0), "", 1)
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _call(text: str, names: set[str]) -> dict[str, Any] | None:
    try:
        value, _ = json.JSONDecoder().raw_decode(text.strip())
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _arguments(arguments)
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments)},
    }


class CallFilter:
    """A stream's text while tools may be called: text streams as content until a call may be
    starting (the `<tool_call>` tag, or any text when the call is `forced`), and the rest is
    held for `finish`."""

    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self.text = ""
        self.sent = 0
        self.holding = forced

    def push(self, piece: str) -> str:
        """What of `piece` may be sent as content now."""
        self.text += piece
        if self.holding:
            return ""
        at = self.text.find(_CALL_OPEN, self.sent)
        if at >= 0:
            self.holding = True
            end = at
        else:  # a tail that may begin the tag waits
            end = len(self.text)
            for k in range(min(len(_CALL_OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if _CALL_OPEN.startswith(self.text[-k:]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, tools: list[Tool]) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet and the calls, at the end of the reply."""
        content, calls = parse_calls(self.text, tools, self.forced)
        if not calls:
            return self.text[self.sent :], []
        rest = content or ""
        sent = self.text[: self.sent]
        return (rest[len(sent) :] if rest.startswith(sent) else ""), calls
