"""Every stop path drains. SIGTERM and SIGINT, sent to the head alone or to the server's whole
process group (systemd's `KillMode=control-group`, `timeout(1)`, `kill -- -PGID`, Ctrl-C),
with one, two data-parallel or two pipeline ranks: a streamed request in flight finishes,
new requests and /health answer 503 meanwhile, the `--trace` is written, the exit code is 0
and no process of the server's session is left. Past `--shutdown-timeout` the requests in
flight end with an error their client sees; a second signal stops at once; a SIGKILLed head
takes its ranks with it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tandem.testing.server_process import Server

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp1": (),
    "dp2": ("--data-parallel-size", "2"),
    "pp2": ("--pipeline-parallel-size", "2"),
}

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow


class StreamedRequest:
    """One streamed completion on a thread; `outcome` is "finished" ([DONE] after a
    finish_reason), "error: ..." (an error event or a broken connection) or None (running)."""

    def __init__(self, server: Server, max_tokens: int):
        self.outcome: str | None = None
        self.first_token = threading.Event()
        body = {"model": "tiny-moe", "prompt": "in flight", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(f"{server.url}/completions", body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        reasons, error = [], None
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        error = event["error"]["message"]
                        continue
                    self.first_token.set()
                    reasons += [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.outcome = f"error: {error}" if error else ("finished" if reasons else "error: no finish_reason")
        self.first_token.set()

    def wait(self, timeout_s: float = 60) -> str:
        self._thread.join(timeout_s)
        assert self.outcome is not None, "the streamed request neither finished nor failed"
        return self.outcome


def _wait_health(server: Server, status: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{server.base}/health", timeout=5).status_code == status:
            return
        time.sleep(0.05)
    raise AssertionError(f"/health did not answer {status} within {timeout_s:g} s")


def _start(tmp_path, layout: str, *extra: str) -> tuple[Server, os.PathLike]:
    trace = tmp_path / "serve.json"
    server = Server("tiny-moe", *LAYOUTS[layout], "--kv-cache-tokens", "2048", "--trace", str(trace), *extra,
                    env={"OMP_NUM_THREADS": "1"})
    return server, trace


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("target", ["head", "group"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_drains_writes_the_trace_and_leaves_nothing(sig, target, layout, tmp_path):
    server, trace = _start(tmp_path, layout, "--shutdown-timeout", "60")
    try:
        request = StreamedRequest(server, max_tokens=160)  # still streaming while the 503s are checked
        assert request.first_token.wait(60) and request.outcome is None, request.outcome
        server.send(sig, group=target == "group")
        _wait_health(server, 503)
        late = httpx.post(f"{server.url}/completions", json={"model": "tiny-moe", "prompt": "late", "max_tokens": 2},
                          timeout=30)
        assert late.status_code == 503 and "shutting down" in late.text, late.text
        assert request.wait() == "finished"
        assert server.proc.wait(timeout=60) == 0, server.output()
        output = server.output()
        assert "draining" in output and "engine failure" not in output and "leaked" not in output, output
        assert json.loads(trace.read_text())["traceEvents"]
        assert server.leftover() == []
    finally:
        server.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_under_torchrun_a_stop_signal_drains_too(sig, tmp_path):
    # torchrun starts each rank in a session of its own and relays a stop signal it gets to
    # each rank's process group: rank 0's holds the front end, which drains.
    trace = tmp_path / "serve.json"
    server = Server("tiny-moe", "--kv-cache-tokens", "2048", "--trace", str(trace), "--shutdown-timeout", "20",
                    torchrun_nproc=2, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=300)
    try:
        request = StreamedRequest(server, max_tokens=160)  # still streaming while the 503s are checked
        assert request.first_token.wait(60) and request.outcome is None, request.outcome
        server.send(sig, group=True)
        _wait_health(server, 503)
        assert request.wait() == "finished"
        # torchrun's own exit code after a signal is 1 whatever its workers did: it re-raises
        # the signal as SignalException once they have exited.
        assert server.proc.wait(timeout=60) == 1
        output = server.output()
        assert "draining" in output and "[tandem] stopped" in output, output
        assert "engine failure" not in output and "SignalException: Process" in output, output
        assert json.loads(trace.read_text())["traceEvents"]
        assert server.leftover() == []
    finally:
        server.kill()


def test_past_the_shutdown_timeout_the_request_in_flight_ends_with_an_error(tmp_path):
    server, trace = _start(tmp_path, "dp2", "--shutdown-timeout", "1")
    try:
        request = StreamedRequest(server, max_tokens=1900)
        assert request.first_token.wait(60) and request.outcome is None, request.outcome
        server.send(signal.SIGTERM, group=True)
        outcome = request.wait()
        assert outcome.startswith("error: ") and "--shutdown-timeout 1 s" in outcome, outcome
        assert server.proc.wait(timeout=60) == 0, server.output()
        assert json.loads(trace.read_text())["traceEvents"]
        assert server.leftover() == []
    finally:
        server.kill()


def test_a_second_signal_stops_at_once_and_leaves_nothing(tmp_path):
    server, _ = _start(tmp_path, "dp2", "--shutdown-timeout", "600")
    try:
        request = StreamedRequest(server, max_tokens=1900)
        assert request.first_token.wait(60) and request.outcome is None, request.outcome
        server.send(signal.SIGTERM, group=True)
        _wait_health(server, 503)
        started = time.monotonic()
        server.send(signal.SIGINT)
        server.proc.wait(timeout=30)
        assert time.monotonic() - started < 30  # not the 600 s drain
        assert request.wait().startswith("error: ")
        assert "second stop signal" in server.output(), server.output()
        assert server.leftover() == []
    finally:
        server.kill()


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_a_killed_head_takes_its_ranks_with_it(layout, tmp_path):
    server, _ = _start(tmp_path, layout)
    try:
        ranks = server.children
        assert len(ranks) >= 2
        server.proc.send_signal(signal.SIGKILL)  # the head alone: nothing can run on its way out
        server.proc.wait(timeout=10)
        assert server.leftover() == []
    finally:
        server.kill()
