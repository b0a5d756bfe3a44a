"""`tool_choice: auto` through the HTTP app and the official `openai` client: an engine that
answers a scripted Hermes-format reply (a random model never writes one), byte by byte. The
reply parses to the same tool calls and content whether streamed or not, and a template that
does not write Hermes calls leaves the reply as content."""

from __future__ import annotations

import json
from typing import AsyncIterator

import openai
import pytest

from tandem.engine.outputs import RequestOutput
from tandem.worker.sampling import SamplingParams
from tandem.serving.openai.api_server import create_app
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.live_app import LiveServer

REPLY = ('I will look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>\n'
         '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "weather?"}]


class ScriptedEngine(FakeEngine):
    """Replies `REPLY` one byte token at a time, then stops; records each request's prompt."""

    def __init__(self, chat_template: str | None = None) -> None:
        super().__init__()
        self.max_model_len = 4096  # room for the tools the prompt lists
        self.chat_template = chat_template
        self.prompts: list[str] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        data = REPLY.encode()
        for k, byte in enumerate(data):
            last = k == len(data) - 1
            yield RequestOutput(request_id, [byte], chr(byte), finished=last, finish_reason="stop" if last else None,
                                num_prompt_tokens=len(prompt_ids), num_output_tokens=k + 1)


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture(scope="module")
def oai(engine):
    live = LiveServer(create_app(engine))
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
    live.stop()


def test_auto_reply_becomes_tool_calls_streamed_and_not(oai, engine):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert '"name": "get_weather"' in engine.prompts[-1] and "<tool_call>" in engine.prompts[-1]  # tools shown

    content, streamed, reason = "", {}, None
    for chunk in oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for item in c.delta.tool_calls or []:
                call = streamed.setdefault(item.index, {"name": "", "arguments": "", "id": None})
                call["id"] = item.id or call["id"]
                call["name"] += item.function.name or ""
                call["arguments"] += item.function.arguments or ""
            reason = c.finish_reason or reason
    assert reason == "tool_calls" and content.strip() == "I will look."
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls
    assert all(c["id"] for c in streamed.values())


def test_tool_choice_none_keeps_the_reply_as_content(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == REPLY and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_template_without_hermes_calls_leaves_auto_replies_as_content():
    live = LiveServer(create_app(ScriptedEngine("{% for m in messages %}{{ m['content'] }}{% endfor %}")))
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        assert r.choices[0].message.content == REPLY and r.choices[0].message.tool_calls is None
    finally:
        live.stop()


def test_a_template_that_writes_hermes_calls_gets_auto_replies_parsed():
    qwen_like = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> reply with "
                 "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    engine = ScriptedEngine(qwen_like)
    live = LiveServer(create_app(engine))
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "add"]
        assert engine.prompts[-1].startswith('<tools>{"type": "function"')
    finally:
        live.stop()
