"""Faults against real `tandem serve` subprocesses: an exception inside a ubatch (on every rank,
and on one rank only), a slow and a hung rank, a rank killed mid-step under load. Every
wait is bounded; each test asserts the responses, `/health`, timing bounds and that no
process outlives the server."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tandem.testing.server_process import Server, complete, get_health, stop_and_check_no_orphans, wait_unhealthy

DBO_FLAGS = ("--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8")
LONG_PROMPT = "a prompt long enough to split into two ubatches"  # well over 8 tokens: prefill uses DBO
SHORT_PROMPT = "hi"  # under 8 tokens, and one decode token per step: never split


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _eventually_metric(server: Server, name: str, expected: float, timeout_s: float = 10) -> None:
    """Engine stats reach the front end every 0.25 s: wait for them."""
    deadline = time.monotonic() + timeout_s
    while _metric(server, name) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, name) == expected, name


def _rank_pids(server: Server) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", server.output())}


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_ubatch_fault_fails_its_requests_and_serving_goes_on(dp):
    # Ubatch 1 raises before decoder layer 2 in the first DBO step from step 20 on, on every
    # rank (like a model bug): the ranks' all-to-alls stay matched.
    env = {"TANDEM_FAULT_INJECT": "ubatch=1,layer=2,step=20"}
    with Server("tiny-moe", "--data-parallel-size", str(dp), *DBO_FLAGS, "--kv-cache-tokens", "4096", env=env) as server:
        reference = complete(server, LONG_PROMPT, 6)  # its DBO prefill runs before step 20
        assert reference.status_code == 200, reference.text
        filler = complete(server, SHORT_PROMPT, 24)  # 24+ steps, none split
        assert filler.status_code == 200, filler.text
        assert _metric(server, "tandem_engine_failed_steps_total") == 0

        started = time.monotonic()
        failed = complete(server, LONG_PROMPT, 6)
        assert time.monotonic() - started < 10
        assert failed.status_code == 500
        message = failed.json()["error"]["message"]
        assert "InjectedFault" in message and "ubatch 1" in message and "layer 2" in message, message
        assert get_health(server).status_code == 200

        # A streamed request after the fault, and the reference again: same tokens as before.
        with httpx.stream("POST", f"{server.url}/completions", timeout=60, json={
            "model": "tiny-moe", "prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True,
        }) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        again = complete(server, LONG_PROMPT, 6)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        _eventually_metric(server, "tandem_engine_failed_steps_total", dp)  # one step, on every rank
        _eventually_metric(server, "tandem_engine_kv_usage_ratio", 0)
        assert "rank 0: model step failed: InjectedFault" in server.output()
        assert get_health(server).status_code == 200
        stop_and_check_no_orphans(server)


@pytest.mark.slow
def test_fault_on_one_rank_only_is_bounded_by_the_step_timeout():
    # Rank 1 alone raises mid-step: rank 0 is left waiting in an all-to-all that will never
    # complete. The step timeout bounds it (here the normal loop, where the forward runs on
    # the loop's own thread: the rank's watchdog ends it); the engine then reports itself
    # unavailable.
    env = {"TANDEM_FAULT_INJECT": "ubatch=1,layer=2,rank=1"}
    step_timeout = 4
    with Server("tiny-moe", "--data-parallel-size", "2", *DBO_FLAGS, "--step-timeout", str(step_timeout),
                "--disable-overlap-schedule", env=env) as server:
        started = time.monotonic()
        response = complete(server, LONG_PROMPT, 6)
        assert response.status_code == 500
        health, _ = wait_unhealthy(server, 30)
        elapsed = time.monotonic() - started
        print(f"fault on rank 1 only: answered {response.status_code}, engine unavailable after {elapsed:.2f} s")
        assert step_timeout - 1 < elapsed < step_timeout + 15
        assert health.status_code == 503 and health.json()["reason"]
        rejected = complete(server, SHORT_PROMPT, 2)
        assert rejected.status_code == 503 and "unavailable" in rejected.json()["error"]["message"]
        # The watchdogs' report. Both ranks are stuck (rank 1 waits for rank 0 after its failed
        # step), and on a loaded machine rank 1's exit can reach the head before rank 0 prints.
        deadline = time.monotonic() + 10
        while not re.search(r"rank \d: no progress for", server.output()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert re.search(r"rank \d: no progress for", server.output()), server.output()
        stop_and_check_no_orphans(server)


def test_watchdog_fires_once_when_the_loop_stops_beating():
    from tandem.serving.ranks.rank import Watchdog

    fired: list[float] = []
    watchdog = Watchdog(0.4, fired.append).start()
    for _ in range(8):  # a loop beating every 0.1 s is never stuck
        time.sleep(0.1)
        watchdog.beat()
    assert fired == []
    time.sleep(1.0)  # no beat for longer than the timeout
    assert len(fired) == 1 and fired[0] > 0.4
    watchdog.stop()
    with pytest.raises(ValueError):
        Watchdog(0, fired.append)


@pytest.mark.slow
def test_slow_rank_is_not_declared_dead_but_a_hung_one_is():
    # Rank 1 sleeps 3 s in one step (slow, under the 8 s step timeout), later 600 s (hung).
    step_timeout = 8
    env = {"TANDEM_FAULT_INJECT": "kind=sleep,seconds=3,rank=1,step=12;kind=sleep,seconds=600,rank=1,step=45"}
    with Server("tiny-moe", "--data-parallel-size", "2", "--step-timeout", str(step_timeout), env=env) as server:
        statuses: list[int] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                statuses.append(get_health(server).status_code)
                time.sleep(0.2)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        started = time.monotonic()
        slow = complete(server, SHORT_PROMPT, 16)  # runs through step 12
        took = time.monotonic() - started
        stop.set()
        poller.join(timeout=10)
        assert slow.status_code == 200 and slow.json()["usage"]["completion_tokens"] == 16
        assert took >= 3
        assert statuses and set(statuses) == {200}

        # The hung step: the stream stops producing tokens, then ends with an error event.
        events, hung_at = [], None
        with httpx.stream("POST", f"{server.url}/completions", timeout=60, json={
            "model": "tiny-moe", "prompt": SHORT_PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True,
        }) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if '"error"' not in line:
                        hung_at = time.monotonic()  # the last token before the hang
            ended = time.monotonic()
        assert '"error"' in events[-1], events[-3:]
        print(f"hung rank: stream ended with an error {ended - hung_at:.2f} s after its last token "
              f"(step timeout {step_timeout} s); the slow step took {took:.2f} s with /health 200 throughout")
        assert step_timeout - 1 < ended - hung_at < step_timeout + 15, ended - hung_at
        health = get_health(server)
        assert health.status_code == 503 and "rank" in health.json()["reason"]
        assert complete(server, SHORT_PROMPT, 2).status_code == 503
        stop_and_check_no_orphans(server)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_rank_killed_mid_step_under_load(victim):
    with Server("tiny-moe", "--data-parallel-size", "2", *DBO_FLAGS, "--kv-cache-tokens", "4096") as server:
        pids = _rank_pids(server)
        assert sorted(pids) == [0, 1]
        streaming = asyncio.Event()
        outcomes: list[str] = []

        async def one(client: httpx.AsyncClient, i: int) -> None:
            body = {"model": "tiny-moe", "prompt": f"stream {i} " * 3, "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", f"{server.url}/completions", json=body) as response:
                assert response.status_code == 200
                last = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        last = line
                        streaming.set()
            outcomes.append("error" if '"error"' in last else "done" if last == "data: [DONE]" else f"cut: {last}")

        async def main() -> tuple[float, httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(16)]
                await asyncio.wait_for(streaming.wait(), 30)
                await asyncio.sleep(0.5)  # mid-decode for everyone
                os.kill(pids[victim], signal.SIGKILL)
                killed = time.monotonic()
                while time.monotonic() - killed < 30:
                    health = await client.get(f"{server.base}/health")
                    if health.status_code != 200:
                        break
                    await asyncio.sleep(0.05)
                noticed = time.monotonic() - killed
                await asyncio.wait_for(asyncio.gather(*tasks), 30)  # every stream ends, none hangs
                return noticed, health

        noticed, health = asyncio.run(main())
        print(f"rank {victim} SIGKILLed: /health non-200 after {noticed:.2f} s")
        assert noticed <= 30
        assert health.status_code == 503
        assert f"rank {victim}" in health.json()["reason"] and "SIGKILL" in health.json()["reason"]
        assert len(outcomes) == 16 and outcomes.count("error") >= 1
        assert set(outcomes) <= {"error", "done"}, outcomes
        rejected = complete(server, SHORT_PROMPT, 2)
        assert rejected.status_code == 503
        assert f"rank {victim}" in rejected.json()["error"]["message"]
        assert "engine failure" in server.output()
        stop_and_check_no_orphans(server)
