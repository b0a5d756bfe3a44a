"""SIGTERM (what systemd, Docker and Kubernetes send) stops `tandem serve` exactly as Ctrl-C
does: a graceful drain, the `--trace` written, every rank process gone, nothing leaked."""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest

from tests.support.server_process import Server, pid_alive

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_drains_writes_the_trace_and_stops_every_rank(sig, tmp_path):
    trace = tmp_path / "serve.json"
    server = Server("tiny-moe", "--kv-cache-tokens", "2048", "--trace", str(trace))
    try:
        children = server.children
        assert children
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny-moe", prompt="hello", max_tokens=4).usage.completion_tokens >= 1
        assert server.stop(sig=sig) == 130  # the same exit whichever signal stopped it
        output = server.output()
        assert "shutting down" in output, output
        assert "leaked" not in output, output  # e.g. multiprocessing's "leaked semaphore objects"
        assert json.loads(trace.read_text())  # the rank's trace was written on the way out
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if pid_alive(pid)] == []
    finally:
        server.kill()
