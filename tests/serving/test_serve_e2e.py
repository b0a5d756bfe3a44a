"""`tandem serve` as users run it: a real subprocess (one rank, and two ranks with DBO),
driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tandem.testing.server_process import Server, pid_alive, rank_pids, wait_healthy
from tandem.distributed.launch import find_free_port

DBO_FLAGS = ("--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8")


@pytest.fixture(scope="module")
def dp1():
    with Server("tiny-moe", "--kv-cache-tokens", "4096", "--block-size", "8") as server:
        yield server


@pytest.fixture(scope="module")
def dp2():
    with Server("tiny-moe", "--data-parallel-size", "2", *DBO_FLAGS, "--kv-cache-tokens", "4096") as server:
        yield server


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dp1", "dp2"])
def test_completion_chat_stream_stop_and_seeds(which, request):
    server = request.getfixturevalue(which)
    client = _client(server)
    done = client.completions.create(
        model="tiny-moe", prompt="Hello", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    text = done.choices[0].text
    assert done.usage.completion_tokens == 10 and done.usage.prompt_tokens == 5
    assert done.choices[0].finish_reason == "length" and text

    streamed = client.completions.create(
        model="tiny-moe", prompt="Hello", max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text

    stop = text[3:5]
    stopped = client.completions.create(
        model="tiny-moe", prompt="Hello", max_tokens=10, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].text == text[: text.find(stop)] and stopped.choices[0].finish_reason == "stop"

    chat = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 6
    chunks = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content

    seeded = [
        client.completions.create(model="tiny-moe", prompt="Seeds", max_tokens=12, temperature=1.0, seed=s,
                                  extra_body={"ignore_eos": True}).choices[0].text
        for s in (11, 11, 12)
    ]
    assert seeded[0] == seeded[1] and seeded[0] != seeded[2]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dp1", "dp2"])
def test_32_concurrent_streams_complete_with_their_lengths(which, request):
    server = request.getfixturevalue(which)
    client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model="tiny-moe", prompt=f"request {i} " * (1 + i % 5), max_tokens=4 + i % 13, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        usage, reason = None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return i, usage, reason

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=240)
        finally:
            await client.close()

    for i, completion_tokens, reason in asyncio.run(main()):
        assert (completion_tokens, reason) == (4 + i % 13, "length"), i
    if which == "dp2":
        assert _metric(server, "tandem_engine_ubatched_steps_total") > 0


@pytest.mark.slow
def test_overlap_and_normal_loops_serve_identical_tokens(dp1):
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]

    def run(server):
        client = _client(server)
        return [
            client.completions.create(model="tiny-moe", prompt=p, max_tokens=12, temperature=0.8, seed=3,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for p in prompts
        ]

    overlapped = run(dp1)
    with Server("tiny-moe", "--kv-cache-tokens", "4096", "--block-size", "8", "--disable-overlap-schedule") as normal:
        assert "schedule=normal" in normal.output()
        assert run(normal) == overlapped


@pytest.mark.slow
def test_aborted_stream_frees_its_kv_blocks(dp1):
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{dp1.url}/completions",
            json={"model": "tiny-moe", "prompt": "x" * 600, "max_tokens": 1200, "stream": True, "ignore_eos": True},
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept alive: dropping the iterator closes the stream
            for line in lines:
                if line.startswith("data: {"):
                    break
            deadline = time.monotonic() + 10
            while _metric(dp1, "tandem_engine_kv_usage_ratio") == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _metric(dp1, "tandem_engine_kv_usage_ratio") > 0
        # The client went away mid-stream.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _metric(dp1, "tandem_engine_kv_usage_ratio") == 0 and _metric(dp1, "tandem_engine_requests_running") == 0:
            break
        time.sleep(0.1)
    assert _metric(dp1, "tandem_engine_kv_usage_ratio") == 0
    assert _metric(dp1, "tandem_engine_requests_running") == 0


@pytest.mark.slow
def test_bad_requests_get_4xx_and_the_server_keeps_serving(dp1):
    url = f"{dp1.url}/completions"
    cases = [
        (b"{not json", 400),
        ({"model": "no-such-model", "prompt": "hi"}, 404),
        ({"model": "tiny-moe", "prompt": "hi", "max_tokens": -1}, 400),
        ({"model": "tiny-moe", "prompt": "y" * 2100, "max_tokens": 4}, 400),
    ]
    for body, status in cases:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        response = httpx.post(url, timeout=30, **kwargs)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["message"]
    too_long = httpx.post(url, json={"model": "tiny-moe", "prompt": "y" * 2100, "max_tokens": 4}, timeout=30)
    assert "context length" in too_long.json()["error"]["message"]
    assert httpx.get(f"{dp1.base}/health", timeout=10).status_code == 200
    assert _client(dp1).completions.create(model="tiny-moe", prompt="ok", max_tokens=3).choices[0].text is not None


@pytest.mark.slow
def test_ctrl_c_stops_server_and_every_rank():
    server = Server("tiny-moe", "--data-parallel-size", "2")
    children = server.children
    assert len(children) >= 2
    started = time.monotonic()
    assert server.stop() == 0 or server.proc.returncode in (0, 130)
    assert time.monotonic() - started < 45
    time.sleep(0.5)
    assert [pid for pid in children if pid_alive(pid)] == []
    server.kill()


@pytest.mark.slow
def test_two_node_torchrun_start_on_loopback():
    master_port, http_port = find_free_port(), find_free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    serve = ["-m", "tandem", "serve", "tiny-moe", "--port", str(http_port), *DBO_FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen([*torchrun, *common, "--node-rank", str(rank), *serve], env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for rank in (0, 1)
    ]
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_healthy(base, 180, nodes)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny-moe", prompt="two nodes", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5
        children = rank_pids([n.pid for n in nodes])
        for node in nodes:
            node.send_signal(subprocess.signal.SIGTERM)
        for node in nodes:
            node.wait(timeout=60)
        time.sleep(0.5)
        assert [pid for pid in children if pid_alive(pid)] == []
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, subprocess.signal.SIGKILL)
                node.wait(timeout=10)
