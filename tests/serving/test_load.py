"""A short load test against a real `tandem serve --data-parallel-size 2 --enable-dbo` with a
request cap: 64 streaming clients for three short rounds (`benchmarks/load.py` is the long
version). Every request completes, is rejected with 429 (full queue), or was walked away
from on purpose; the engine drains to no running request and no KV after every round; the
servers' memory does not keep growing."""

from __future__ import annotations

import sys

import httpx
import pytest

from tandem.testing.load import LoadConfig, format_round, metric, run_load
from tandem.testing.server_process import Server, rank_pids

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

FLAGS = (
    "--data-parallel-size", "2", "--enable-dbo", "--dbo-decode-token-threshold", "8",
    "--dbo-prefill-token-threshold", "64", "--kv-cache-tokens", "8192", "--max-queue-len", "40",
)


def test_64_streaming_clients_with_a_full_queue_lose_nothing():
    with Server("tiny-moe", *FLAGS) as server:

        def pids() -> dict[str, int]:
            return {"server": server.proc.pid, **{f"child {pid}": pid for pid in rank_pids([server.proc.pid])}}

        config = LoadConfig(clients=64, round_s=5, rounds=3, min_tokens=4, max_tokens=24, disconnect_every=8,
                            request_timeout_s=60, drain_timeout_s=30)
        rounds = run_load(server.base, config, pids, log=lambda line: print(line, file=sys.stderr))
        for r in rounds:
            assert r.errors == [] and r.outcomes["error"] == 0, format_round(r)
            assert r.unaccounted == 0
            assert r.outcomes["completed"] > 0 and r.outcomes["disconnected"] > 0
            assert (r.running_after, r.waiting_after, r.kv_usage_after) == (0, 0, 0), format_round(r)
        assert sum(r.outcomes["rejected_429"] for r in rounds) > 0  # the queue cap was hit...
        assert all(r.outcomes["rejected_503"] == 0 for r in rounds)  # ...and the engine never failed
        assert metric(server.base, "tandem_engine_ubatched_steps_total") > 0
        # Memory: after the first round warmed everything up, no growth beyond noise.
        assert rounds[-1].rss_total_mb <= rounds[1].rss_total_mb * 1.05 + 32, [r.rss_mb for r in rounds]
        assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
