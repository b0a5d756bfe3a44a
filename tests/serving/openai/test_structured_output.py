"""A real `tandem serve` (tiny-moe, random weights) and the official `openai` client:
`response_format` and `tools`/`tool_choice` by constrained decoding. The text is gibberish,
but it must be JSON that validates against the schema asked for."""

from __future__ import annotations

import json
import sys

import jsonschema
import openai
import pytest

from tandem.testing.server_process import Server

MODEL = "tiny-moe"

# Bounded strings and numbers: a random model given free rein inside a string or a number
# rarely closes it.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "member"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with Server(MODEL, "--kv-cache-tokens", "4096") as live:
        yield live


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.slow
def test_json_schema_chat_greedy_and_sampled(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                    response_format=_person_format())
    assert r.choices[0].finish_reason == "stop"  # the grammar ended the reply, not max_tokens
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=3, n=3,
                                    response_format=_person_format())
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.slow
def test_json_schema_on_completions_streamed_and_not(oai):
    body = {"response_format": _person_format()}
    r = oai.completions.create(model=MODEL, prompt="A person:", max_tokens=120, temperature=0, extra_body=body)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    streamed = "".join(c.text for chunk in oai.completions.create(model=MODEL, prompt="A person:", max_tokens=120,
                                                                  temperature=0, stream=True, extra_body=body)
                       for c in chunk.choices)
    assert streamed == r.choices[0].text


@pytest.mark.slow
def test_json_object_gives_a_json_object(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=300,
                                    temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_unconstrained_requests_are_unchanged_beside_constrained_ones(oai):
    plain = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    alone = oai.chat.completions.create(**plain).choices[0].message.content
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(oai.chat.completions.create, model=MODEL, messages=ASK, max_tokens=120,
                                   temperature=0, response_format=_person_format()) for _ in range(3)]
        beside = pool.submit(oai.chat.completions.create, **plain)
        assert beside.result().choices[0].message.content == alone
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), PERSON)


def _check_call(call, name=None):
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.slow
def test_tool_choice_required_gives_valid_tool_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                    temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        _check_call(call)
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                    temperature=1.0, seed=5, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    _check_call(r.choices[0].message.tool_calls[0])


@pytest.mark.slow
def test_named_tool_choice_calls_that_tool(oai):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=100,
                                    temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) reason for a named call
    [call] = choice.message.tool_calls
    _check_call(call, "get_weather")


@pytest.mark.slow
def test_tool_choice_none_gives_no_tool_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                    temperature=0)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")


def _streamed_calls(oai, **kwargs):
    calls, content, reason = {}, "", None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                call = calls.setdefault(item.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = item.id or call["id"]
                if item.function is not None:
                    call["name"] += item.function.name or ""
                    call["arguments"] += item.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], content, reason


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_streamed_tool_calls_reassemble_to_the_same_calls(oai, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    calls, content, reason = _streamed_calls(oai, **kwargs)
    assert reason == whole.finish_reason and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                           for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls)


@pytest.mark.slow
def test_a_tool_call_history_renders(oai):
    """A conversation that called a tool and got its result back (what agents send next)."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow
@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "missing"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "'uniqueItems' (at #)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "tools[0].function.parameters", "nowhere"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "min_tokens"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(oai, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error


def test_without_xgrammar_a_constraint_is_a_400_naming_the_package(monkeypatch):
    from tandem.serving.openai.protocol import APIError
    from tandem.serving.openai.structured import parse_tool_choice, parse_tools, response_format_schema

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now fails
    with pytest.raises(APIError) as info:
        response_format_schema({"type": "json_object"})
    assert info.value.status == 400 and info.value.param == "response_format" and "xgrammar" in info.value.message
    with pytest.raises(APIError) as info:
        parse_tool_choice("required", parse_tools(TOOLS), None)
    assert info.value.param == "tool_choice" and "tandem[structured]" in info.value.message
    assert response_format_schema({"type": "text"}) is None  # free text needs nothing
    assert parse_tool_choice("auto", parse_tools(TOOLS), None).json_schema() is None
