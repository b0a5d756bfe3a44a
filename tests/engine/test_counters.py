"""One time model, typed end to end: `measure_step` measures a step into `StepTimes`, ranks
report `RankCounters` that merge without string keys, overlap efficiency has one definition,
and the benchmark keeps its planners in the runtime's `PlannerCache`."""

from __future__ import annotations

import time

import pytest

from tandem.config import OverlapConfig
from tandem.contexts import StepTimes, measure_step, timed_blocking
from tandem.contexts.time_model import overlap_efficiency
from tandem.engine.counters import RankCounters
from tandem.worker.planner_cache import PlannerCache


class _Executor:
    """What `measure_step` reads of a ubatch executor: its running switch time."""

    switch_time_s = 0.0


def test_measure_step_splits_the_wall_time_into_the_time_model():
    executor = _Executor()
    with measure_step(executor) as measured:
        with timed_blocking():
            time.sleep(0.02)
        handed_over = time.perf_counter()
        time.sleep(0.005)
        executor.switch_time_s += time.perf_counter() - handed_over  # as the executor counts a hand-over
    times = measured.times
    assert times.recv_wait_s >= 0.02 and times.comm_s == times.recv_wait_s
    assert times.switch_s == pytest.approx(executor.switch_time_s) and times.switch_s >= 0.005
    assert times.step_s == pytest.approx(times.compute_s + times.recv_wait_s + times.switch_s)
    assert times.overlap_efficiency == 0.0  # a synchronous collective hides nothing


def test_measure_step_still_measures_a_step_that_raises():
    with pytest.raises(RuntimeError):
        with measure_step(_Executor()) as measured:
            raise RuntimeError("boom")
    assert measured.times is not None and measured.times.step_s >= 0


def test_overlap_efficiency_has_one_definition():
    assert overlap_efficiency(4.0, 1.0) == 0.75 and overlap_efficiency(0.0, 0.0) == 0.0
    assert overlap_efficiency(1.0, 2.0) == 0.0  # waits longer than the transfers hide nothing
    assert StepTimes(comm_s=4.0, recv_wait_s=1.0).overlap_efficiency == 0.75
    blocked = StepTimes(1.0, 0.5, 0.25, 1.0, 0.25).with_blocking(0.5)
    assert blocked.as_tuple() == (1.5, 0.5, 0.75, 1.5, 0.25)
    assert StepTimes.mean([StepTimes(2.0, 1.0), StepTimes(4.0, 3.0)]).as_tuple() == (3.0, 2.0, 0.0, 0.0, 0.0)


def test_rank_counters_merge_typed():
    a = RankCounters(waiting=1, running=2, kv_usage=0.5, steps=10, generated_tokens=7, preemptions=1,
                     times=StepTimes(1.0, 0.5, 0.25, 1.0, 0.25), pipeline_stage_idle_fraction=[0.1, 0.3])
    b = RankCounters(waiting=3, running=0, kv_usage=0.75, steps=10, generated_tokens=5, failed_steps=1,
                     times=StepTimes(2.0, 1.5, 0.25, 0.5, 0.25), pipeline_stage_idle_fraction=[0.3, 0.5])
    total = RankCounters.merge([a, b])
    assert (total.waiting, total.running, total.steps, total.generated_tokens) == (4, 2, 20, 12)
    assert (total.preemptions, total.failed_steps, total.kv_usage) == (1, 1, 0.75)
    assert total.times == StepTimes(3.0, 2.0, 0.5, 1.5, 0.5)
    assert total.pipeline_stage_idle_fraction == pytest.approx([0.2, 0.4])
    assert RankCounters.merge([]) == RankCounters()


def test_planner_counters_merge_typed_over_the_ranks_that_run_a_planner():
    from tandem.ubatch.planner import PlannerStats

    a = PlannerStats(choices={"none": 3, "dbo-2": 5}, explored_steps=1, predicted_steps=6,
                     predicted_s=0.5, measured_s=0.625, abs_error_s=0.125)
    b = PlannerStats(choices={"none": 1, "sbo": 2}, explored_steps=0, predicted_steps=2,
                     predicted_s=0.25, measured_s=0.25, abs_error_s=0.0)
    total = RankCounters.merge([RankCounters(planner=a), RankCounters(), RankCounters(planner=b)])
    assert total.planner == PlannerStats(choices={"none": 4, "dbo-2": 5, "sbo": 2}, explored_steps=1,
                                         predicted_steps=8, predicted_s=0.75, measured_s=0.875, abs_error_s=0.125)
    assert a.choices == {"none": 3, "dbo-2": 5}  # the ranks' own counters are left as they were
    assert RankCounters.merge([RankCounters(), RankCounters()]).planner is None


def test_an_engine_reports_a_snapshot_of_its_planner():
    from tandem.engine.build import build_engine
    from tandem.config import EngineConfig
    from tandem.worker.sampling import SamplingParams

    config = EngineConfig(model="tiny-moe", overlap=OverlapConfig(enable_dbo=True, overlap_policy="auto"))
    engine = build_engine(config)
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_work:
            engine.step()
        snapshot = engine.stats().planner
        assert sum(snapshot.choices.values()) == engine.runner.steps > 0
        engine.add_request("b", [4, 5], SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_work:
            engine.step()
        assert sum(engine.stats().planner.choices.values()) > sum(snapshot.choices.values())  # not a live view
    finally:
        engine.close()


def test_planner_cache_keeps_one_planner_per_setting():
    cache = PlannerCache()
    auto = OverlapConfig(enable_dbo=True, overlap_policy="auto")
    planner = cache.planner(auto, sbo=False)
    assert planner is not None and cache.planner(OverlapConfig(enable_dbo=True, overlap_policy="auto"), sbo=False) is planner
    assert cache.planner(auto, sbo=True) is not planner
    assert cache.planner(OverlapConfig(enable_dbo=True), sbo=False) is None  # static thresholds: no planner


def test_the_bench_keeps_its_planners_in_the_runtime_cache():
    from tandem.bench.workloads import MoEStack, mode_overlap

    stack = MoEStack(0, 1, backend="local", num_ubatches=2, layers=1, hidden=16, intermediate=16, experts=4, top_k=2)
    overlap = mode_overlap(OverlapConfig(), "auto")
    times = [stack.step_overlap(overlap, 8, None) for _ in range(3)]
    assert all(t.step_s == pytest.approx(t.compute_s + t.recv_wait_s + t.switch_s) for t in times)
    planner = stack.planners.planner(overlap, sbo=False)
    assert sum(planner.stats.choices.values()) == 3  # every step was chosen by, and fed back to, that planner
