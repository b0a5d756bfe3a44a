"""`--cpu-threads auto`: each kind of step runs on whichever thread count its own timed
forwards found faster, re-tried as load changes (`tandem.worker.step_threads`)."""

from __future__ import annotations

import pytest
import torch

from tandem.worker import step_threads
from tandem.worker.step_threads import StepThreads, step_kind, step_threads_for


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter the step bodies advance; torch's thread count restored after."""
    before = torch.get_num_threads()
    now = [0.0]
    monkeypatch.setattr(step_threads.time, "perf_counter", lambda: now[0])
    yield now
    torch.set_num_threads(before)


def _steps(policy, clock, decode_only, tokens, cost, count):
    """Run `count` steps whose forward takes cost[threads] seconds; the thread counts used."""
    used = []
    for _ in range(count):
        with policy.running(decode_only, tokens):
            threads = torch.get_num_threads()
            clock[0] += cost[threads]
        used.append(threads)
    return used


def test_each_kind_of_step_keeps_its_faster_thread_count(clock):
    torch.set_num_threads(2)
    policy = StepThreads(2, trial_steps=3, recheck_every=1000)
    # Trials alternate (both counts see the same load), starting away from the current count;
    # then the faster, 1 thread, for this kind.
    small = _steps(policy, clock, True, 8, {1: 1.0, 2: 1.5}, 12)
    assert small == [1, 2, 1, 2, 1, 2] + [1] * 6
    large = _steps(policy, clock, True, 512, {1: 2.0, 2: 1.1}, 12)
    assert large == [2, 1, 2, 1, 2, 1] + [2] * 6
    assert _steps(policy, clock, True, 7, {1: 9.0, 2: 9.0}, 1) == [1]  # 7 tokens: the 8-token kind, decided
    # Steps with prefill always run on every thread, untimed.
    assert _steps(policy, clock, False, 8, {1: 0.1, 2: 9.0}, 3) == [2, 2, 2]
    assert policy.steps_by_threads == {1: 13, 2: 15}


def test_a_recheck_follows_a_change_in_load(clock):
    torch.set_num_threads(2)
    policy = StepThreads(2, trial_steps=2, recheck_every=5)
    first = _steps(policy, clock, True, 4, {1: 1.0, 2: 3.0}, 10)
    # Trials, then 1 thread; its 5th step starts a re-check: both are timed again.
    assert first == [1, 2, 1, 2] + [1] * 5 + [2]
    # The cores free up mid-check: that check still keeps 1 thread (the 2-thread median
    # holds a sample from before), the next one finds 2 threads faster.
    later = _steps(policy, clock, True, 4, {1: 1.0, 2: 0.4}, 12)
    assert later == [1, 2] + [1] * 5 + [2, 1, 2] + [2, 2]


def test_step_kinds_round_the_token_count_up_to_a_power_of_two():
    assert [step_kind(True, n)[1] for n in (1, 2, 3, 8, 9, 500)] == [1, 2, 4, 8, 16, 512]
    assert step_kind(True, 8) != step_kind(False, 8)


def test_the_policy_runs_only_on_a_cpu_rank_with_threads_to_choose_from():
    assert step_threads_for("fixed", torch.device("cpu")) is None
    assert step_threads_for("auto", torch.device("cuda")) is None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert step_threads_for("auto", torch.device("cpu")) is None
        torch.set_num_threads(2)
        assert step_threads_for("auto", torch.device("cpu")).choices == (1, 2)
        assert step_threads_for("auto", torch.device("cpu"), compiled=True) is None
    finally:
        torch.set_num_threads(before)


def test_an_engine_config_takes_auto_or_fixed():
    from tandem.config import EngineConfig

    assert EngineConfig().cpu_threads == "auto"
    with pytest.raises(ValueError, match="--cpu-threads must be one of auto, fixed, got 'two'"):
        EngineConfig(cpu_threads="two")


def test_the_process_gets_its_thread_count_back_when_the_engine_closes(clock):
    """The choice is the steps' alone: a second runner built in the same process read one
    thread as its rank's count (no policy, and its engine's overlap default flipped), which
    made the TBO test's step counts depend on the machine's load."""
    from tandem.config import CacheConfig, EngineConfig
    from tandem.engine.offline import build_runner, generate
    from tandem.worker.sampling import SamplingParams

    torch.set_num_threads(2)
    policy = StepThreads(2, trial_steps=3, recheck_every=1000)
    assert _steps(policy, clock, True, 8, {1: 1.0, 2: 1.5}, 7)[-1] == 1 and torch.get_num_threads() == 1
    policy.restore()
    assert torch.get_num_threads() == 2

    # A real engine: its decode trials alternate 1, 2, 1 threads (the fake clock ties them).
    runner = build_runner(EngineConfig(model="tiny-moe", device="cpu", cache=CacheConfig(num_kv_blocks=16, block_size=4)))
    generate(runner, [(0, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
    assert runner.threads.steps_by_threads[1] == 2
    assert torch.get_num_threads() == 2
