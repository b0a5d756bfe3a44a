"""The OpenAI-compatible HTTP app, served by a real uvicorn server over an in-memory engine
and driven by the official `openai` client (and httpx for raw cases)."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tandem.models.tiny_moe import EOS_ID, build_tokenizer
from tandem.serving.openai.api_server import create_app
from tandem.serving.openai.chat_template import ChatTemplateError, render_chat
from tandem.serving.engine_client import EngineOverloadedError, EngineUnavailableError
from tests.support.fake_engine import MAX_MODEL_LEN, MODEL, FakeEngine
from tests.support.live_app import LiveServer, assert_openai_error, wait_until

API_KEY = "sk-test-key"
MAX_REQUEST_BYTES = 20_000


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(create_app(engine, api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES))
    yield live
    live.stop()


@pytest.fixture(autouse=True)
def _fresh_engine(engine):
    engine.reset()
    yield
    engine.reset()


@pytest.fixture
def oai(server) -> openai.OpenAI:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=10, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def ids(text: str) -> list[int]:
    return build_tokenizer().encode(text).ids


# ------------------------------------------------------------------ completions and chat


def test_completion(oai, engine):
    r = oai.completions.create(model=MODEL, prompt="hello", max_tokens=7, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == FakeEngine.reference_text(ids("hello"), None, 7)
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 7, 12)
    ((prompt, params),) = engine.requests.values()
    assert prompt == ids("hello") and params.max_tokens == 7 and params.temperature == 0


def test_completion_defaults_and_token_prompt(oai, engine):
    r = oai.completions.create(model=MODEL, prompt=[104, 105])  # token ids, default max_tokens 16
    assert r.choices[0].text == FakeEngine.reference_text([104, 105], None, 16)
    assert r.usage.completion_tokens == 16
    r = oai.completions.create(model=MODEL, prompt=["hi"], max_tokens=3)  # a batch of one
    assert r.choices[0].text == FakeEngine.reference_text(ids("hi"), None, 3)


def test_completion_stream(oai):
    stream = oai.completions.create(model=MODEL, prompt="stream me", max_tokens=9, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == FakeEngine.reference_text(ids("stream me"), None, 9)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == len(ids("stream me"))


def test_chat(oai, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    prompt = ids("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == FakeEngine.reference_text(prompt, None, 6)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 6)
    # Without max_tokens, the reply may fill the rest of the context.
    r = oai.chat.completions.create(model=MODEL, messages=messages)
    assert r.usage.completion_tokens == MAX_MODEL_LEN - len(prompt)
    # max_completion_tokens and text content parts
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                    max_completion_tokens=2)
    assert r.usage.completion_tokens == 2
    assert list(engine.requests.values())[-1][0] == ids("<|user|>\nh\ni\n<|assistant|>\n")


def test_chat_stream(oai):
    messages = [{"role": "user", "content": "tell me"}]
    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = ids("<|user|>\ntell me\n<|assistant|>\n")
    assert content == FakeEngine.reference_text(prompt, None, 8)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_n_fans_out_with_seeds(oai, engine):
    r = oai.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=2, seed=10, temperature=0.7)
    assert [c.index for c in r.choices] == [0, 1]
    for i, choice in enumerate(r.choices):
        assert choice.text == FakeEngine.reference_text(ids("abc"), 10 + i, 5)
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == 3
    assert sorted(rid.rsplit("-", 1)[1] for rid in engine.started) == ["0", "1"]
    assert sorted(p.seed for _, p in engine.requests.values()) == [10, 11]
    # streamed chat with n=2
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                         n=2, seed=3, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    prompt = ids("<|user|>\nx\n<|assistant|>\n")
    assert texts == [FakeEngine.reference_text(prompt, 3, 4), FakeEngine.reference_text(prompt, 4, 4)]


def test_stop_strings_and_stop_tokens(oai):
    full = FakeEngine.reference_text(ids("q"), None, 40)
    stop = full[10:13]
    expected = full[: full.index(stop)]
    r = oai.completions.create(model=MODEL, prompt="q", max_tokens=40, stop=[stop, "zzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    stream = oai.completions.create(model=MODEL, prompt="q", max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected
    r = oai.completions.create(model=MODEL, prompt="q", max_tokens=40, extra_body={"stop_token_ids": [ord(full[4])]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:4], "stop")


def test_models_endpoint(oai):
    (card,) = oai.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert oai.models.retrieve(MODEL).id == MODEL


# ------------------------------------------------------------------ validation


def test_unknown_model_is_404(oai, http):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-nope", prompt="hi")
    assert info.value.code == "model_not_found"
    r = http.post("/v1/chat/completions", json={"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]})
    assert assert_openai_error(r, 404, param="model")["code"] == "model_not_found"


def test_malformed_json_and_wrong_types_are_400(http):
    r = http.post("/v1/completions", content=b'{"model": "tiny-fake", "prompt": ', headers={"Content-Type": "application/json"})
    assert assert_openai_error(r, 400, contains="malformed JSON")["type"] == "invalid_request_error"
    assert_openai_error(http.post("/v1/completions", content=b"[1, 2]"), 400, contains="JSON object")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": "abc"})
    assert_openai_error(r, 400, param="max_tokens")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": 12.5})
    assert_openai_error(r, 400, param="prompt", contains="list of token ids")


def test_unknown_fields_are_ignored_with_a_warning_except_in_messages(http, caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.serving.openai.api_server"):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": True,
                                               "stream_options": {"include_usage": True, "extra": 1}})
    assert r.status_code == 200, r.text
    assert "frobnicate" in caplog.text and "stream_options.extra" in caplog.text
    # In a message, a misspelt key would silently change the prompt: still a 400.
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x", "mood": 1}]})
    assert_openai_error(r, 400, param="messages[0].mood", contains="unknown field")


def test_model_is_optional_and_integral_floats_are_integers(http, engine):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3.0, "n": 2.0, "seed": 7.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL and len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_vllm_sampling_extensions_reach_the_engine(oai, engine):
    oai.completions.create(model=MODEL, prompt="hi", max_tokens=5, presence_penalty=0.5, frequency_penalty=-0.25,
                           best_of=1, extra_body={"min_tokens": 3, "repetition_penalty": 1.3, "top_k": 4,
                                                  "min_p": 0.1, "ignore_eos": True})
    params = engine.requests[engine.started[-1]][1]
    assert (params.min_tokens, params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
            params.top_k, params.min_p, params.ignore_eos) == (3, 1.3, 0.5, -0.25, 4, 0.1, True)


def test_chat_template_kwargs_and_tools_reach_the_template():
    engine = FakeEngine()
    engine.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if tools %}[tools:{{ tools | length }}]{% endif %}"
                            "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}>{% endif %}")
    with TestClient(create_app(engine)) as client:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Q"}], "max_tokens": 1, "tools": tools, "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": True}})
        assert r.status_code == 200, r.text
        prompt = engine.tokenizer.decode(engine.requests[engine.started[-1]][0])
        assert prompt == "Q[tools:1]<think>>"
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Q"}], "max_tokens": 1, "add_generation_prompt": False})
        assert engine.tokenizer.decode(engine.requests[engine.started[-1]][0]) == "Q"
        for fields, param in (({"tools": tools, "tool_choice": "sometimes"}, "tool_choice"),
                              ({"response_format": {"type": "yaml"}}, "response_format.type"),
                              ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Q"}], **fields})
            assert_openai_error(r, 400, param=param)


def test_stream_continuous_usage_stats(oai):
    stream = oai.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in with_text)
    assert [c.usage.completion_tokens for c in with_text] == sorted(c.usage.completion_tokens for c in with_text)
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


def test_bad_values_are_400(oai, http, engine):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=-3)
    assert "max_tokens" in str(info.value)
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0}), 400,
                        param="max_tokens")
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="x" * 120, max_tokens=20)
    assert "context length" in str(info.value)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "y" * 200}]})
    assert_openai_error(r, 400, contains="context length")
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400, contains="empty")
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400, contains="empty")
    for n in (0, 1000):
        assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "n": n}), 400, param="n")
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "temperature": -1}), 400,
                        contains="temperature")
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, -5]}), 400, param="prompt")
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400,
                        param="messages")
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": image}]})
    assert_openai_error(r, 400, contains="only 'text' content parts")
    assert engine.started == []  # nothing invalid reached the engine


def test_oversized_body_is_413(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (MAX_REQUEST_BYTES + 10)})
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    chunked = iter([b'{"model": "tiny-fake", "prompt": "', b"x" * MAX_REQUEST_BYTES, b'"}'])  # no Content-Length
    assert_openai_error(http.post("/v1/completions", content=chunked), 413)


def test_fastapi_validation_errors_become_400():
    app = create_app(FakeEngine())

    @app.get("/v1/echo-int")
    async def echo_int(x: int) -> dict:
        return {"x": x}

    with TestClient(app) as client:
        assert client.get("/v1/echo-int", params={"x": 3}).json() == {"x": 3}
        assert_openai_error(client.get("/v1/echo-int", params={"x": "abc"}), 400, param="x")
        assert_openai_error(client.get("/v1/nothing-here"), 404)


# ------------------------------------------------------------------ auth, engine errors, health, metrics


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=10) as raw:
        assert assert_openai_error(raw.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        r = raw.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert_openai_error(r, 401, contains="invalid API key")
        assert_openai_error(raw.get("/v1/models"), 401)
        assert raw.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert raw.get("/health").status_code == 200
        assert raw.get("/metrics").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi")


def test_engine_errors_map_to_503_and_429(oai, engine):
    engine.raise_on_generate = EngineUnavailableError("rank 1 died")
    with pytest.raises(openai.InternalServerError) as info:
        oai.completions.create(model=MODEL, prompt="hi")
    assert info.value.status_code == 503 and "rank 1 died" in str(info.value)
    with pytest.raises(openai.InternalServerError) as info:  # a stream is refused before it starts
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    assert info.value.status_code == 503
    engine.raise_on_generate = EngineOverloadedError("queue full")
    with pytest.raises(openai.RateLimitError) as info:
        oai.completions.create(model=MODEL, prompt="hi")
    assert info.value.status_code == 429


def test_error_output(oai, engine):
    engine.error_after = 3
    with pytest.raises(openai.InternalServerError) as info:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=10)
    assert info.value.status_code == 500 and "simulated engine failure" in str(info.value)
    stream = oai.completions.create(model=MODEL, prompt="hi", max_tokens=10, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="simulated engine failure"):
        for chunk in stream:
            received.append(chunk.choices[0].text)
    assert "".join(received) == FakeEngine.reference_text(ids("hi"), None, 3)


def test_unexpected_exception_is_500_without_leaking(http, engine, caplog):
    engine.raise_on_generate = RuntimeError("SECRET-PROMPT-CONTENT")
    with caplog.at_level(logging.DEBUG, logger="tandem.serving"):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "SECRET-PROMPT-CONTENT"})
    assert assert_openai_error(r, 500)["type"] == "server_error"
    assert "SECRET" not in r.text
    assert "SECRET" not in caplog.text and "RuntimeError" in caplog.text


def test_health(http, engine):
    r = http.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    engine.healthy = (False, "rank 2 stopped stepping")
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "rank 2 stopped stepping"


def test_metrics(oai, http):
    oai.completions.create(model=MODEL, prompt="count me", max_tokens=4)
    list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                     stream=True))
    http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    text = http.get("/metrics").text
    for needle in [
        'tandem_http_requests_total{endpoint="/v1/completions",status="200"}',
        'tandem_http_requests_total{endpoint="/v1/chat/completions",status="200"}',
        'tandem_http_requests_total{endpoint="/v1/completions",status="404"}',
        "tandem_http_request_duration_seconds_bucket",
        'tandem_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"}',
        "tandem_prompt_tokens_total",
        "tandem_generation_tokens_total",
        "tandem_generation_tokens_per_second",
        "tandem_engine_healthy 1.0",
        "tandem_engine_requests_waiting",
        "tandem_engine_requests_running",
        "tandem_engine_kv_usage_ratio 0.25",
        "tandem_engine_steps_total",
        "tandem_engine_ubatched_steps_total",
        "tandem_engine_ubatch_yields_total",
        "tandem_engine_step_time_seconds_total",
    ]:
        assert needle in text, needle
    generated = [line for line in text.splitlines() if line.startswith("tandem_generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 7


def test_two_apps_in_one_process_have_their_own_metrics():
    a, b = create_app(FakeEngine()), create_app(FakeEngine())
    with TestClient(a) as ca, TestClient(b) as cb:
        ca.get("/health")
        assert 'tandem_http_requests_total{endpoint="/health",status="200"} 1.0' in ca.get("/metrics").text
        assert 'endpoint="/health"' not in cb.get("/metrics").text


# ------------------------------------------------------------------ disconnects


def test_client_disconnect_mid_stream_aborts_the_request(server, engine):
    engine.token_delay = 0.05  # 100 tokens: 5 s if nobody aborts it
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True}
    with httpx.Client(base_url=server.url, timeout=10, headers={"Authorization": f"Bearer {API_KEY}"}) as raw:
        with raw.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            (rid,) = engine.started
    t0 = time.monotonic()
    wait_until(lambda: rid in engine.aborted, 3.0, "the engine to see the abort")
    assert time.monotonic() - t0 < 3.0 and rid not in engine.finished


def test_client_disconnect_while_waiting_aborts_the_request(server, engine):
    engine.token_delay = 0.05
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 100}
    with httpx.Client(base_url=server.url, timeout=0.5, headers={"Authorization": f"Bearer {API_KEY}"}) as raw:
        with pytest.raises(httpx.ReadTimeout):
            raw.post("/v1/completions", json=body)
    wait_until(lambda: len(engine.aborted) == 1, 3.0, "the engine to see the abort")


# ------------------------------------------------------------------ chat templates


def test_render_chat_default_and_jinja():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}]
    assert render_chat(messages, None) == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert render_chat(messages, template, bos_token="<s>", eos_token="</s>") == "<s>[system]s</s>[user]u</s>[assistant]"
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        render_chat(messages, strict)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        render_chat(messages, "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="image_url"):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None)


def test_model_chat_template_is_used():
    engine = FakeEngine()
    engine.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    with TestClient(create_app(engine, served_model_name="served-name")) as client:
        r = client.post("/v1/chat/completions", json={"model": "served-name", "max_tokens": 3,
                                                       "messages": [{"role": "user", "content": "yo"}]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "served-name"
        ((prompt, _),) = engine.requests.values()
        assert prompt == ids("user: yo\nassistant:")  # the model's template writes its own special tokens
    # A template that does not compile is refused when the app is built.
    engine.chat_template = "{% for %}"
    with pytest.raises(ValueError, match="chat template"):
        create_app(engine)


def test_request_content_is_logged_only_when_asked(caplog):
    body = {"model": MODEL, "prompt": "PRIVATE-words", "max_tokens": 3}
    for log_requests in (False, True):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="tandem.serving"):
            with TestClient(create_app(FakeEngine(), log_requests=log_requests)) as client:
                assert client.post("/v1/completions", json=body).status_code == 200
        assert "cmpl-" in caplog.text  # requests are logged either way...
        assert ("PRIVATE-words" in caplog.text) == log_requests  # ...their content only when asked


# ------------------------------------------------------------------ vLLM's operational endpoints


def test_tokenize_detokenize_and_tokenizer_info(http):
    r = http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == ids("hello") and body["count"] == len(ids("hello"))
    assert body["max_model_len"] == MAX_MODEL_LEN and len(body["token_strs"]) == body["count"]
    r = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == build_tokenizer().encode("<|user|>\nhi\n<|assistant|>\n", add_special_tokens=False).ids
    assert http.post("/detokenize", json={"tokens": ids("hello")}).json() == {"prompt": "hello"}
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, param="tokens")
    assert_openai_error(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, param="model")
    info = http.get("/tokenizer_info").json()
    assert info["model_max_length"] == MAX_MODEL_LEN and info["eos_token_ids"] == [EOS_ID]


def test_version_ping_and_head_health(server, engine):
    with httpx.Client(base_url=server.url, timeout=10) as anonymous:  # open without the API key
        assert anonymous.get("/version").json()["version"]
        assert anonymous.get("/ping").status_code == 200 and anonymous.post("/ping").status_code == 200
        head = anonymous.head("/health")
        assert head.status_code == 200 and head.content == b""
        engine.healthy = (False, "rank 1 died")
        assert anonymous.head("/health").status_code == 503 and anonymous.get("/ping").status_code == 503


def test_client_gone_mid_upload_is_499_not_500(server, http):
    def statuses() -> dict[str, float]:
        found = {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('tandem_http_requests_total{endpoint="/v1/completions"'):
                found[line.split('status="')[1].split('"')[0]] = float(line.split()[-1])
        return found

    before = statuses()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 5000\r\n\r\n{\"prompt\": \"")
        time.sleep(0.2)
    wait_until(lambda: statuses().get("499", 0) == before.get("499", 0) + 1, 10, "the 499 to be counted")
    assert statuses().get("500", 0) == before.get("500", 0)


# ------------------------------------------------------------------ batched prompts


def test_batched_prompts_with_n_are_indexed_prompt_major(oai, engine):
    prompts = ["alpha", "beta gamma", "d"]
    r = oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, seed=5)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        prompt, k = prompts[c.index // 2], c.index % 2
        assert c.text == FakeEngine.reference_text(ids(prompt), 5 + k, 3)
    assert r.usage.prompt_tokens == sum(len(ids(p)) for p in prompts)  # each prompt once, not per choice
    assert r.usage.completion_tokens == 18
    tokens = oai.completions.create(model=MODEL, prompt=[ids("ab"), ids("c")], max_tokens=2)
    assert [c.text for c in tokens.choices] == [FakeEngine.reference_text(ids(p), None, 2) for p in ("ab", "c")]


def test_batched_prompts_stream_with_their_indices(oai):
    texts: dict[int, str] = {}
    for chunk in oai.completions.create(model=MODEL, prompt=["x", "yy"], max_tokens=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: FakeEngine.reference_text(ids("x"), None, 3), 1: FakeEngine.reference_text(ids("yy"), None, 3)}


def test_a_bad_prompt_in_a_batch_is_named(http, engine):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["ok", ""]})
    assert_openai_error(r, 400, param="prompt[1]", contains="empty")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [10**9]]})
    assert_openai_error(r, 400, param="prompt[1]", contains="out of range")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["ok", "y" * 200]})
    assert_openai_error(r, 400, param="prompt[1]", contains="context length")
    assert engine.started == []
