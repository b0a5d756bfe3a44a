"""A short soak (`benchmarks/soak.py` is the long one) against a real `tandem serve
--data-parallel-size 2 --enable-dbo` with a small KV cache and a small step budget: waves
of streamed requests with hang-ups, aborts, n > 1, long prompts that chunk and preempt,
structured output and logprobs, and one adversarial wave (a new schema, stop strings or
logit-bias map per request, hang-ups mid-grammar). Every request ends accounted for, the
engine returns to idle with no KV in use after every wave, and neither memory nor open file
descriptors of the server's processes grow after the warm-up wave."""

from __future__ import annotations

import sys

import pytest

from tandem.testing.soak import HEADER, SERVE_FLAGS, SoakConfig, format_wave, growth, run_wave, server_processes
from tandem.testing.server_process import Server

pytestmark = pytest.mark.slow

def test_waves_of_mixed_requests_end_accounted_for_and_leak_nothing():
    config = SoakConfig(clients=12, wave_requests=48)
    with Server("tiny-moe", *SERVE_FLAGS, env={"OMP_NUM_THREADS": "1"}) as server:
        waves = []
        print(HEADER, file=sys.stderr)
        for index in range(4):
            wave = run_wave(server.base, config, index, lambda: server_processes(server.proc.pid))
            print(format_wave(wave), file=sys.stderr)
            waves.append(wave)
        for wave in waves:
            assert wave.problems == [] and wave.outcomes["lost"] == 0 and wave.unaccounted == 0, wave
            assert wave.server_errors == 0, wave.outcomes
            assert (wave.running_after, wave.waiting_after, wave.kv_usage_after) == (0, 0, 0), format_wave(wave)
        assert sum(w.outcomes["hung_up"] for w in waves) > 0 and sum(w.outcomes["finished"] for w in waves) > 0
        kinds = ("n", "long", "json", "logprobs", "schema", "grammar_hangup", "stop", "bias")
        assert all(sum(w.kinds.get(k, 0) for w in waves) > 0 for k in kinds), [w.kinds for w in waves]
        assert [w.adversarial for w in waves] == [False, False, True, False]
        assert waves[-1].preemptions_total > 0  # the long prompts did not fit side by side
        grown = growth(waves, warmup=1)
        assert grown.rss <= 0.02 and grown.fds <= 0.02, [(w.rss_mb, w.open_fds) for w in waves]
