"""Bad input and the security limits: malformed bodies of every kind get 4xx JSON errors, the
per-key stream cap answers 429, binding beyond loopback without a key warns, and a
schemathesis fuzz of the OpenAPI schema against a real `tandem serve` finds no 5xx."""

from __future__ import annotations

import collections
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from tandem.serving.openai.api_server import create_app
from tandem.testing.server_process import Server
from tests.support.fake_engine import MAX_MODEL_LEN, MODEL, FakeEngine
from tests.support.live_app import LiveServer, assert_openai_error, wait_until

MAX_REQUEST_BYTES = 4096

BAD_BODIES = [
    # (raw body, status, error param, text in the message)
    (b'{"model": "tiny-fake", "prompt": "\xff\xfe caf\xe9"}', 400, None, "UTF-8"),
    (b'{"model": "tiny-fake", "prompt": "hi", "temperature": NaN}', 400, None, "NaN"),
    (b'{"model": "tiny-fake", "prompt": "hi", "top_p": Infinity}', 400, None, "Infinity"),
    (b"[" * 2000 + b"]" * 2000, 400, None, "nested too deeply"),
    (b'["model", "prompt"]', 400, None, "JSON object"),
    (b'"just a string"', 400, None, "JSON object"),
    (b"", 400, None, "empty"),
    (b"{", 400, None, "malformed JSON"),
]

BAD_FIELDS = [
    # (completion request fields, status, error param, text in the message)
    ({"max_tokens": 10**30}, 400, "max_tokens", "maximum context length"),
    ({"max_tokens": 2**63}, 400, "max_tokens", "maximum context length"),
    ({"max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"max_tokens": "16"}, 400, "max_tokens", "integer"),
    ({"max_tokens": 1.5}, 400, "max_tokens", "integer"),
    ({"seed": 2**70}, 400, "seed", "64-bit"),
    ({"seed": -(2**64)}, 400, "seed", "64-bit"),
    ({"temperature": "hot"}, 400, "temperature", "number"),
    ({"temperature": -1}, 400, "temperature", "temperature"),
    ({"top_p": 5}, 400, "top_p", "top_p"),
    ({"top_k": -7}, 400, "top_k", "top_k"),
    ({"n": 1000}, 400, "n", "between 1 and"),
    ({"stream": "yes"}, 400, "stream", "boolean"),
    ({"stop": [1, 2]}, 400, "stop", "string"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids", "non-negative"),
    ({"logit_bias": {"five": 1}}, 400, "logit_bias", "decimal integers"),
    ({"logit_bias": {"-5": 1}}, 400, "logit_bias", "decimal integers"),
    ({"logit_bias": {"5": 100.5}}, 400, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "high"}}, 400, "logit_bias.5", "number"),
    ({"logit_bias": {"5000000": 1}}, 400, "logit_bias", "out of range"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", "at most 300"),
    ({"min_tokens": 17}, 400, "min_tokens", "min_tokens"),
    ({"min_tokens": -1}, 400, "min_tokens", "min_tokens"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -9}, 400, "frequency_penalty", "[-2, 2]"),
    ({"min_p": 1.5}, 400, "min_p", "min_p"),
    ({"best_of": 3}, 400, "best_of", "must equal 'n'"),
    ({"suffix": "tail"}, 400, "suffix", "not supported"),
    ({"max_tokens": 2.0, "min_tokens": 3.5}, 400, "min_tokens", "integer"),
    ({"prompt": [10**12]}, 400, "prompt", "out of range"),
    ({"prompt": [-5, 3]}, 400, "prompt", "out of range"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": "y" * (MAX_MODEL_LEN + 10)}, 400, "prompt", "maximum context length"),
    ({"prompt": None}, 400, "prompt", "prompt"),
    ({"model": 7}, 400, "model", "string"),
]


@pytest.fixture(scope="module")
def client():
    engine = FakeEngine()
    with TestClient(create_app(engine, max_request_bytes=MAX_REQUEST_BYTES)) as test_client:
        test_client.engine = engine
        yield test_client


@pytest.mark.parametrize("body,status,param,text", BAD_BODIES)
def test_malformed_bodies_are_4xx_json(client, body, status, param, text):
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, status, param=param, contains=text)


@pytest.mark.parametrize("fields,status,param,text", BAD_FIELDS)
def test_bad_fields_are_4xx_json(client, fields, status, param, text):
    body = {"model": MODEL, "prompt": "hello", **fields}
    assert_openai_error(client.post("/v1/completions", json=body), status, param=param, contains=text)


def test_bad_chat_fields_and_methods_are_4xx_json(client):
    chat = "/v1/chat/completions"
    assert_openai_error(client.post(chat, json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
                        400, contains="role")
    assert_openai_error(client.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
                        400, contains="content")
    assert_openai_error(client.post(chat, json={"model": MODEL, "messages": "hi"}), 400, param="messages")
    assert_openai_error(client.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "x",
                                                                              "secret": 1}]}), 400, contains="unknown")
    assert_openai_error(client.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_completion_tokens": 10**9}), 400, contains="context length")
    assert_openai_error(client.get("/v1/completions"), 405)
    assert_openai_error(client.post("/v1/nowhere", json={}), 404)


def test_oversized_bodies_are_413(client):
    big = {"model": MODEL, "prompt": "x" * MAX_REQUEST_BYTES}
    assert_openai_error(client.post("/v1/completions", json=big), 413, contains=str(MAX_REQUEST_BYTES))
    chunks = iter([b'{"model": "tiny-fake", "prompt": "'] + [b"x" * 1000] * 5 + [b'"}'])  # no Content-Length
    assert_openai_error(client.post("/v1/completions", content=chunks), 413)
    assert_openai_error(client.post("/v1/completions", content=b"{}", headers={"content-length": "99999999"}), 413)
    assert client.engine.started == []  # nothing bad reached the engine
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_streams_per_key_are_capped():
    engine = FakeEngine()
    engine.token_delay = 0.05
    live = LiveServer(create_app(engine, max_streams_per_key=2))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "stream": True}
    key_a, key_b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body, headers=key_a) as first, \
                    http.stream("POST", "/v1/completions", json=body, headers=key_a) as second:
                assert first.status_code == second.status_code == 200
                third = http.post("/v1/completions", json=body, headers=key_a)
                error = assert_openai_error(third, 429, contains="at most 2")
                assert error["code"] == "too_many_streams" and error["type"] == "rate_limit_error"
                assert third.headers["retry-after"] == "1"
                # Another key, a request without a key, and non-streamed requests are not held back.
                with http.stream("POST", "/v1/completions", json=body, headers=key_b) as other:
                    assert other.status_code == 200
                with http.stream("POST", "/v1/completions", json=body) as anonymous:
                    assert anonymous.status_code == 200
                plain = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=key_a)
                assert plain.status_code == 200
                for line in first.iter_lines():  # read one stream to its end
                    pass
            # Both streams closed: the key may open streams again.
            wait_until(lambda: not live.server.config.app.state.tandem.open_streams, 10, "streams released")
            with http.stream("POST", "/v1/completions", json=body, headers=key_a) as again:
                assert again.status_code == 200
            wait_until(lambda: not live.server.config.app.state.tandem.open_streams, 10, "streams released")
    finally:
        live.stop()


def test_binding_beyond_loopback_without_a_key_warns(monkeypatch, capsys):
    import uvicorn

    from tandem.serving import server as server_module

    apps = []

    def fake_run(self, *args, **kwargs):
        apps.append(self.config.app)

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    cases = [("0.0.0.0", None, True), ("192.0.2.7", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False),
             ("::1", None, False), ("localhost", None, False)]
    for host, key, warns in cases:
        http = server_module.HttpOptions(host=host, api_key=key, max_request_bytes=1234, max_streams_per_key=3)
        server_module._serve_http(FakeEngine(), http)
        err = capsys.readouterr().err
        assert ("warning: binding" in err and "without --api-key" in err) == warns, (host, key, err)
    state = apps[-1].state.tandem
    assert state.max_request_bytes == 1234 and state.max_streams_per_key == 3


@pytest.mark.slow
def test_schemathesis_fuzz_finds_no_server_error():
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    # A short context keeps every valid request's generation cheap.
    with Server("tiny-moe", "--max-model-len", "48", "--kv-cache-tokens", "2048", "--max-request-bytes", "65536") as server:
        schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
        seen: collections.Counter = collections.Counter()
        server_errors = []
        started = time.monotonic()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            for op in operations:
                if mode is schemathesis.GenerationMode.NEGATIVE and "requestBody" not in op.definition.raw:
                    continue  # nothing to get wrong in a request without a body or parameters

                @settings(max_examples=50, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
                @given(case=op.as_strategy(generation_mode=mode))
                def call(case):
                    response = case.call(base_url=server.base, timeout=60)
                    seen[(op.label, mode.value, response.status_code // 100)] += 1
                    if response.status_code >= 500:
                        server_errors.append((op.label, case.body, response.status_code, response.text[:300]))

                call()
        print(f"fuzzed {sum(seen.values())} requests in {time.monotonic() - started:.1f} s: {dict(seen)}", file=sys.stderr)
        assert server_errors == []
        # Valid requests ran on the engine, invalid ones were refused.
        assert seen[("POST /v1/completions", "positive", 2)] > 0 and seen[("POST /v1/chat/completions", "positive", 2)] > 0
        assert seen[("POST /v1/completions", "negative", 4)] > 0
        # The flags reached the app: a body over --max-request-bytes is a 413.
        big = {"model": "tiny-moe", "prompt": "x" * 70000}
        assert httpx.post(f"{server.url}/completions", json=big, timeout=30).status_code == 413
        assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
        ok = httpx.post(f"{server.url}/completions", json={"model": "tiny-moe", "prompt": "still here", "max_tokens": 4},
                        timeout=30)
        assert ok.status_code == 200


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", '{"model": "%s", "prompt": "a\\udcffb"}', "prompt"),
        ("/v1/completions", '{"model": "%s", "prompt": ["ok", "\\ud800"]}', "prompt[1]"),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "stop": ["\\udfff"]}', "stop[0]"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "x\\udcff"}]}',
         "messages[0].content"),
    ],
)
def test_invalid_unicode_in_a_string_field_is_a_400_naming_the_field(client, path, body, param):
    """A lone surrogate is valid JSON but not text: the tokenizer raised TypeError (a 500)."""
    response = client.post(path, content=(body % MODEL).encode(), headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param=param, contains="lone surrogate")


#: A valid body of each POST endpoint with strings in every place its schema has one.
_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "description": "the answer"}}}
STRING_BODIES = {
    "/v1/completions": {
        "model": MODEL, "prompt": ["first", "second"], "stop": ["\n\n", "END"], "user": "someone",
        "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": _SCHEMA}},
    },
    "/v1/chat/completions": {
        "model": MODEL, "stop": "END", "user": "someone",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hello"}]},
        ],
        # tools would render past the fake model's 128-token context; their texts are checked
        # where the body is decoded, like every string here
        "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": _SCHEMA}},
    },
    "/tokenize": {"model": MODEL, "prompt": "count me"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}


def _string_places(value, path=""):
    """(path a refusal names, a function that returns a copy with a lone surrogate there) for
    every string of a JSON value, object keys included (a key is named by its object's path)."""
    import copy

    def spliced(path_parts, make):
        def build(root):
            root = copy.deepcopy(root)
            *parents, last = path_parts
            node = root
            for part in parents:
                node = node[part]
            make(node, last)
            return root

        return build

    def walk(node, parts, named):
        if isinstance(node, str):
            yield named, spliced(parts, lambda parent, key: parent.__setitem__(key, parent[key] + "\udcff"))
        elif isinstance(node, dict):
            for key, item in node.items():
                yield named or None, spliced(parts + [key], lambda parent, k: parent.__setitem__(k + "\udcff", parent.pop(k)))
                yield from walk(item, parts + [key], f"{named}.{key}" if named else key)
        elif isinstance(node, list):
            for index, item in enumerate(node):
                yield from walk(item, parts + [index], f"{named}[{index}]")

    yield from walk(value, [], path)


@pytest.mark.parametrize("endpoint", sorted(STRING_BODIES))
def test_a_lone_surrogate_in_any_string_of_any_endpoint_is_a_400_naming_it(client, endpoint):
    """#34 item 5's fuzz: every string (value or key) of a valid body, in turn, gets a lone
    surrogate (`json.dumps` writes it as the escape `\\udcff`); each is a 400 naming where it sits,
    never a 5xx; the valid body itself is served."""
    import json

    body = STRING_BODIES[endpoint]
    assert client.post(endpoint, json=body).status_code == 200
    places = list(_string_places(body))
    assert len(places) >= 3  # /detokenize: its model and its two keys
    for param, mutate in places:
        raw = json.dumps(mutate(body))
        assert "\\udcff" in raw
        response = client.post(endpoint, content=raw.encode(), headers={"content-type": "application/json"})
        assert_openai_error(response, 400, param=param, contains="lone surrogate")


@pytest.mark.parametrize("escape", ["\\x41", "\\u12G4", "\\U0001F600", "\\q", "\\u00"])
@pytest.mark.parametrize("endpoint", sorted(STRING_BODIES))
def test_an_invalid_escape_in_a_string_is_a_400(client, endpoint, escape):
    import json

    raw = json.dumps(STRING_BODIES[endpoint]).replace('"model": "', '"model": "' + escape, 1)
    response = client.post(endpoint, content=raw.encode(), headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param=None, contains="malformed JSON")
