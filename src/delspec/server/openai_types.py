"""OpenAI request objects of structured output and tool calls: `response_format`, `tools`,
`tool_choice` and the calls of an assistant message. Types are strict, as the request's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JSONSchemaFormat(BaseModel):
    """`response_format.json_schema`: a named schema (`strict`: OpenAI's guarantee, which
    constrained decoding gives whatever its value)."""

    model_config = ConfigDict(strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
