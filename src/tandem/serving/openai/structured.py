"""What a request's output must look like: `response_format` and `tool_choice` as a JSON
schema for constrained decoding (`SamplingParams.json_schema`), checked up front so that a bad
schema is a 400 naming its field.

- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
  "description"?}}` (JSON matching `schema`; always enforced, `strict` or not).
- `tool_choice` (with `tools`): `"none"` and `"auto"` leave decoding free (auto: the output is
  parsed for tool calls in the chat template's format); `"required"` constrains the output to
  a JSON array of `{"name": <a tool's name>, "parameters": <its arguments>}` (at most one item
  with `parallel_tool_calls: false`), and a named function `{"type": "function", "function":
  {"name"}}` to that tool's arguments object, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.worker.grammar import StructuredOutputUnavailable, check_json_schema
from tandem.serving.openai.protocol import invalid_request

#: A JSON object, any keys: `response_format: json_object`.
ANY_JSON_OBJECT = {"type": "object"}


def _check_schema(schema: Any, param: str, feature: str) -> None:
    """`feature`: the request field that asked for constrained decoding."""
    try:
        check_json_schema(schema)
    except StructuredOutputUnavailable as exc:
        raise invalid_request(f"'{feature}' needs constrained decoding, which this server cannot do: {exc}",
                              param=feature) from None
    except ValueError as exc:
        raise invalid_request(f"'{param}' is not a JSON schema this server can enforce: {exc}", param=param) from None


def response_format_schema(response_format: dict[str, Any] | None) -> str | None:
    """The JSON schema (JSON text) `response_format` asks for; None for free text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        _check_schema(ANY_JSON_OBJECT, "response_format", "response_format")
        return json.dumps(ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise invalid_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_request("'response_format.json_schema' must be an object with 'name' and 'schema'",
                              param="response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid_request("'response_format.json_schema.name' must be a non-empty string",
                              param="response_format.json_schema.name")
    if "schema" not in spec:
        raise invalid_request("missing required field 'response_format.json_schema.schema'",
                              param="response_format.json_schema.schema")
    _check_schema(spec["schema"], "response_format.json_schema.schema", "response_format")
    return json.dumps(spec["schema"])


@dataclass(frozen=True)
class Tool:
    name: str
    #: The arguments' JSON schema (any object when the tool gives none).
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[Tool, ...]
    #: The named tool (mode "named").
    name: str | None = None
    parallel: bool = True

    def json_schema(self) -> str | None:
        """The constraint on the output (None: free decoding)."""
        if self.mode == "named":
            return json.dumps(next(t.parameters for t in self.tools if t.name == self.name))
        if self.mode != "required":
            return None
        calls = [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters},
             "required": ["name", "parameters"]}
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)


def parse_tools(tools: list[dict[str, Any]] | None) -> tuple[Tool, ...]:
    """`tools` checked: function tools with a name and, if given, an object schema."""
    parsed = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise invalid_request(f"'{where}.type' must be 'function', got {tool.get('type')!r}", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_request(f"'{where}.function' must be an object with a 'name'", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"'{where}.function.name' must be a non-empty string", param=f"{where}.function.name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = ANY_JSON_OBJECT
        elif not isinstance(parameters, dict):
            raise invalid_request(f"'{where}.function.parameters' must be a JSON schema object",
                                  param=f"{where}.function.parameters")
        parsed.append(Tool(name, parameters))
    names = [t.name for t in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise invalid_request(f"'tools' names the function {duplicate!r} more than once", param="tools")
    return tuple(parsed)


def parse_tool_choice(tool_choice: str | dict[str, Any] | None, tools: tuple[Tool, ...],
                      parallel_tool_calls: bool | None) -> ToolChoice:
    """`tool_choice` (default: "auto" with tools, "none" without) against `tools`; a choice
    that constrains decoding has its schemas checked."""
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none", tools, parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise invalid_request(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got "
                                  f"{tool_choice!r}", param="tool_choice")
        if tool_choice != "none" and not tools:
            raise invalid_request(f"'tool_choice' {tool_choice!r} needs 'tools'", param="tool_choice")
        choice = ToolChoice(tool_choice, tools, parallel=parallel)
    else:
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise invalid_request("a named 'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                  param="tool_choice")
        if name not in {t.name for t in tools}:
            raise invalid_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                                  param="tool_choice.function.name")
        choice = ToolChoice("named", tools, name=name, parallel=parallel)
    if choice.mode in ("required", "named"):
        for i, tool in enumerate(tools):
            if choice.mode == "required" or tool.name == choice.name:
                _check_schema(tool.parameters, f"tools[{i}].function.parameters", "tool_choice")
    return choice


__all__ = ["ANY_JSON_OBJECT", "Tool", "ToolChoice", "parse_tool_choice", "parse_tools", "response_format_schema"]
