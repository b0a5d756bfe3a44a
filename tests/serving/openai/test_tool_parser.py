"""The Hermes tool-call parser and the tool-call stream on fixed strings: what a whole reply
parses to, and that a reply streamed in any pieces reassembles to the same calls and content."""

from __future__ import annotations

import json

import pytest

from tandem.serving.openai.tool_parser import ToolCallStream, finish_reason, parse_hermes, parse_tool_calls

TWO_CALLS = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


def test_hermes_reply_with_two_calls_and_text():
    content, calls = parse_hermes(TWO_CALLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("text", ["no calls here", '<tool_call>{"name": oops}</tool_call>', "<tool_call>[1, 2]</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_text_that_is_not_a_call_stays_content(text):
    assert parse_hermes(text) == (text, [])


def test_a_call_cut_before_its_end_tag_still_counts_when_its_json_is_whole():
    content, calls = parse_hermes('<tool_call>{"name": "f", "arguments": {"x": "</"}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": "</"}')]


def test_required_and_named_replies():
    content, calls = parse_tool_calls("required", '[{"name": "f", "parameters": {"a": [1, "]"]}}, {"name": "g", "parameters": {}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": [1, "]"]}), ("g", {})]
    assert parse_tool_calls("required", '[{"name": "f", "param') == ('[{"name": "f", "param', [])  # cut short
    content, calls = parse_tool_calls("named", '{"a": 1}', "f")
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert parse_tool_calls("named", '{"a": ', "f") == ('{"a": ', [])


def test_finish_reason_follows_openai():
    assert finish_reason("auto", "stop", 1) == "tool_calls"
    assert finish_reason("required", "stop", 2) == "tool_calls"
    assert finish_reason("named", "stop", 1) == "stop"
    assert finish_reason("auto", "stop", 0) == "stop"
    assert finish_reason("required", "length", 0) == "length"


def _reassemble(mode: str, text: str, piece: int, name: str | None = None):
    stream = ToolCallStream(mode, name)
    deltas = []
    for k in range(0, len(text), piece):
        deltas += stream.feed(text[k:k + piece])
    deltas += stream.finish()
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for item in delta.get("tool_calls", []):
            call = calls.setdefault(item["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = item.get("id") or call["id"]
            function = item.get("function", {})
            call["name"] += function.get("name", "")
            call["arguments"] += function.get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], stream.calls


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_hermes_reply_reassembles_to_the_whole_parse(piece):
    content, calls, count = _reassemble("auto", TWO_CALLS, piece)
    whole_content, whole_calls = parse_hermes(TWO_CALLS)
    assert content.strip() == whole_content and count == 2
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert all(c["id"] for c in calls)
    assert _reassemble("auto", "a < b <tool_ and more", piece)[:2] == ("a < b <tool_ and more", [])


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_streamed_required_and_named_replies_reassemble(piece):
    text = '[{"name": "f", "parameters": {"s": "}]\\"{"}}, {"name": "g", "parameters": {"n": 2}}]'
    _, calls, count = _reassemble("required", text, piece)
    assert count == 2
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"s": '}]"{'}), ("g", {"n": 2})]
    _, calls, count = _reassemble("named", '{"a": [1, 2]}', piece, name="f")
    assert count == 1 and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": [1, 2]}'


def test_a_required_call_streams_its_header_first_then_its_arguments_piece_by_piece():
    stream = ToolCallStream("required")
    deltas = []
    for piece in ['[{"name": "f", "para', 'meters": {"a"', ': 1', '}}]']:
        deltas += stream.feed(piece)
    items = [d["tool_calls"][0] for d in deltas]
    assert items[0]["function"] == {"name": "f", "arguments": ""} and items[0]["id"] and items[0]["type"] == "function"
    assert [i["function"]["arguments"] for i in items[1:]] == ['{"a"', ": 1", "}"]
    assert all("id" not in i and i["index"] == 0 for i in items[1:])
