"""Tool calls out of a chat reply, whole (`parse_tool_calls`) or as it streams (`ToolCallStream`).

By `tool_choice` mode (`tandem.serving.openai.structured.ToolChoice`):
- "auto": the reply is parsed in the Hermes format that Qwen-family templates (and this
  server's default chat format) ask for: text, then one or more
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The text before the first call
  is the message content; a call whose body is not such JSON is left in the content.
- "required": the reply is (by constrained decoding) a JSON array of `{"name", "parameters"}`.
- "named": the reply is (likewise) the named tool's arguments object.

Streamed, a call is sent as vLLM does: a delta with its `index`, `id`, `type` and
`function.name` (and, where known, its arguments), then deltas adding to
`function.arguments`; the deltas of one call concatenate to the whole call. Named and
required calls stream their arguments as they are generated; a Hermes call goes out whole
once its `</tool_call>` arrives (its JSON is the model's own, in any layout).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    name: str
    #: JSON text of the arguments object.
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{secrets.token_hex(16)}"

    def message_item(self) -> dict:
        """The call as an item of `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _hermes_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a Hermes-format reply; beside calls, content is None when empty."""
    calls: list[ToolCall] = []
    content = []
    rest = text
    while True:
        start = rest.find(TOOL_CALL_START)
        if start < 0:
            content.append(rest)
            break
        end = rest.find(TOOL_CALL_END, start)
        body = rest[start + len(TOOL_CALL_START): end if end >= 0 else len(rest)]
        call = _hermes_call(body.strip())
        if call is None:
            content.append(rest)  # not a call after all: keep it as text
            break
        content.append(rest[:start])
        calls.append(call)
        if end < 0:
            break
        rest = rest[end + len(TOOL_CALL_END):]
    joined = "".join(content)
    if calls:
        return joined.strip() or None, calls
    return joined, calls


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a `tool_choice: required` reply; [] when it is not a whole array of calls."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(data, list) or not all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in data):
        return []
    return [ToolCall(d["name"], json.dumps(d.get("parameters", {}), ensure_ascii=False)) for d in data]


def parse_tool_calls(mode: str, text: str, name: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply under `tool_choice` mode `mode` ("named": `name`)."""
    if mode == "auto":
        return parse_hermes(text)
    if mode == "required":
        calls = parse_required(text)
        return (None, calls) if calls else (text, [])
    if mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (finish_reason "length"): no whole call to give
        return None, [ToolCall(name or "", text)]
    return text, []


def finish_reason(mode: str, reason: str | None, calls: int) -> str | None:
    """OpenAI's: "tool_calls" when an auto or required reply ended by calling tools; a named
    call keeps "stop"."""
    if calls and reason == "stop" and mode in ("auto", "required"):
        return "tool_calls"
    return reason


def _call_delta(index: int, call: ToolCall) -> dict:
    return {"tool_calls": [{"index": index, **call.message_item()}]}


def _arguments_delta(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


class ToolCallStream:
    """One choice's text deltas in, chat deltas (`{"content"}` or `{"tool_calls"}`) out."""

    def __init__(self, mode: str, name: str | None = None):
        self.mode = mode
        self.name = name
        self.calls = 0
        self._buffer = ""
        # "required": JSON scanner state over the array.
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item_start: int | None = None
        self._arguments_sent: int | None = None
        self._scanned = 0

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.mode == "named":
            deltas = []
            if self.calls == 0:
                self.calls = 1
                deltas.append(_call_delta(0, ToolCall(self.name or "", "")))
            return deltas + [_arguments_delta(0, text)]
        self._buffer += text
        return self._hermes() if self.mode == "auto" else self._required()

    def finish(self) -> list[dict]:
        """Whatever the reply left unsent when it ended."""
        rest, self._buffer = self._buffer, ""
        if self.mode != "auto" or not rest:
            return []
        if rest.startswith(TOOL_CALL_START):
            call = _hermes_call(rest[len(TOOL_CALL_START):].strip())
            if call is not None:  # the reply ended inside a call whose JSON is whole
                self.calls += 1
                return [_call_delta(self.calls - 1, call)]
        return [{"content": rest}]

    def _hermes(self) -> list[dict]:
        deltas = []
        while self._buffer:
            if self._buffer.startswith(TOOL_CALL_START):
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    break  # the call goes on: wait for its end
                body = self._buffer[len(TOOL_CALL_START):end]
                call = _hermes_call(body.strip())
                if call is None:
                    deltas.append({"content": self._buffer[: end + len(TOOL_CALL_END)]})
                else:
                    deltas.append(_call_delta(self.calls, call))
                    self.calls += 1
                self._buffer = self._buffer[end + len(TOOL_CALL_END):]
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                # Hold back a tail that may be the beginning of "<tool_call>".
                keep = next((k for k in range(min(len(self._buffer), len(TOOL_CALL_START) - 1), 0, -1)
                             if TOOL_CALL_START.startswith(self._buffer[-k:])), 0)
                start = len(self._buffer) - keep
                if start == 0:
                    break
            text = self._buffer[:start]
            self._buffer = self._buffer[start:]
            if text.strip() or not self.calls:
                deltas.append({"content": text})
        return deltas

    def _required(self) -> list[dict]:
        """Scan the array: a call's header goes out once `{"name": ..., "parameters": ` is
        whole, then its arguments as they come (the grammar writes exactly that layout); an
        item in another layout goes out whole when it closes."""
        deltas = []
        for i in range(self._scanned, len(self._buffer)):
            ch = self._buffer[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item_start, self._arguments_sent = i, None
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._item_start is not None:
                    deltas += self._item_end(i)
        self._scanned = len(self._buffer)
        if self._item_start is not None:
            deltas += self._item_progress(len(self._buffer))
        return deltas

    def _item_progress(self, end: int) -> list[dict]:
        if self._arguments_sent is None:
            header = _REQUIRED_ITEM_HEADER.match(self._buffer, self._item_start, end)
            if header is None:
                return []
            self._arguments_sent = header.end()
            self.calls += 1
            deltas = [_call_delta(self.calls - 1, ToolCall(json.loads(header.group(1)), ""))]
        else:
            deltas = []
        if end > self._arguments_sent:
            text, self._arguments_sent = self._buffer[self._arguments_sent: end], end
            deltas.append(_arguments_delta(self.calls - 1, text))
        return deltas

    def _item_end(self, close: int) -> list[dict]:
        """The item closed at `close` (its final `}`)."""
        start, sent = self._item_start, self._arguments_sent
        self._item_start = self._arguments_sent = None
        if sent is None:  # not the grammar's layout: the whole item at once
            deltas = []
            for call in parse_required("[" + self._buffer[start: close + 1] + "]"):
                deltas.append(_call_delta(self.calls, call))
                self.calls += 1
            return deltas
        rest = self._buffer[sent:close]  # the arguments' tail, without the item's own `}`
        return [_arguments_delta(self.calls - 1, rest)] if rest else []


#: `{"name": "<tool>", "parameters": ` at the start of a `required` reply's item.
_REQUIRED_ITEM_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "parameters": ')


__all__ = ["TOOL_CALL_END", "TOOL_CALL_START", "ToolCall", "ToolCallStream", "finish_reason", "parse_hermes",
           "parse_required", "parse_tool_calls"]
