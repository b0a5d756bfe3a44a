"""A short soak (`benchmarks/soak.py` is the long one) against a real `tandem serve
--data-parallel-size 2 --enable-dbo` with a small KV cache and a small step budget: waves
of streamed requests with hang-ups, aborts, n > 1, long prompts that chunk and preempt,
structured output and logprobs. Every request ends accounted for, the engine returns to
idle with no KV in use after every wave, and neither memory nor open file descriptors of the
server's processes grow after the warm-up wave."""

from __future__ import annotations

import sys

import pytest

from tandem.testing.soak import HEADER, SERVE_FLAGS, SoakConfig, format_wave, growth, run_wave
from tandem.testing.server_process import Server, rank_pids

pytestmark = pytest.mark.slow

def server_pids(server: Server) -> dict[str, int]:
    return {"head": server.proc.pid, **{f"pid {pid}": pid for pid in rank_pids([server.proc.pid])}}


def test_waves_of_mixed_requests_end_accounted_for_and_leak_nothing():
    config = SoakConfig(clients=12, wave_requests=48)
    with Server("tiny-moe", *SERVE_FLAGS, env={"OMP_NUM_THREADS": "1"}) as server:
        waves = []
        print(HEADER, file=sys.stderr)
        for index in range(4):
            wave = run_wave(server.base, config, index, lambda: server_pids(server))
            print(format_wave(wave), file=sys.stderr)
            waves.append(wave)
        for wave in waves:
            assert wave.problems == [] and wave.outcomes["lost"] == 0 and wave.unaccounted == 0, wave
            assert wave.server_errors == 0, wave.outcomes
            assert (wave.running_after, wave.waiting_after, wave.kv_usage_after) == (0, 0, 0), format_wave(wave)
        assert sum(w.outcomes["hung_up"] for w in waves) > 0 and sum(w.outcomes["finished"] for w in waves) > 0
        assert all(count > 0 for count in (sum(w.kinds[k] for w in waves) for k in ("n", "long", "json", "logprobs")))
        assert waves[-1].preemptions_total > 0  # the long prompts did not fit side by side
        rss, fds = growth(waves, warmup=1)
        assert rss <= 0.02 and fds <= 0.02, [(w.rss_mb, w.open_fds) for w in waves]
