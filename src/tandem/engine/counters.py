"""`RankCounters`: one rank's engine counters, typed from the step that measures them to the
front end that exports them. Ranks send them as they are; the front end merges them
(`RankCounters.merge`) into the one set `/metrics` reads. The time model travels as one
`StepTimes`, the type the model runner measures a step in, never renamed on the way."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

from tandem.contexts import StepTimes
from tandem.ubatch.planner import PlannerStats


@dataclass
class RankCounters:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    steps: int = 0
    ubatched_steps: int = 0
    ubatch_yields: int = 0
    step_time_s: float = 0.0
    forward_busy_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    #: The time model, summed over steps.
    times: StepTimes = field(default_factory=StepTimes)
    failed_steps: int = 0
    #: Pipeline parallelism: each stage's idle (bubble) fraction, stage order; None without PP.
    pipeline_stage_idle_fraction: list | None = None
    #: The overlap planner's counters, if one runs (merged: summed over the ranks that run one).
    planner: PlannerStats | None = None

    @classmethod
    def of(cls, engine) -> "RankCounters":
        """One rank's counters now, read from its `Engine`: the scheduler's queues and KV use,
        the runner's steps and time model, the engine's tokens and failed steps."""
        runner, scheduler = engine.runner, engine.scheduler
        return cls(
            waiting=len(scheduler.waiting),
            running=len(scheduler.running),
            kv_usage=scheduler.kv_usage,
            steps=runner.steps,
            ubatched_steps=runner.ubatched_steps,
            ubatch_yields=runner.ubatch_yields,
            step_time_s=runner.step_time_s,
            forward_busy_s=engine.forward_busy_s,
            prompt_tokens=engine.prompt_tokens,
            generated_tokens=engine.generated_tokens,
            preemptions=scheduler.num_preemptions,
            times=runner.total_step_times,
            failed_steps=engine.failed_steps,
            # A copy: the planner goes on counting while the snapshot is read (in process) or sent.
            planner=copy.deepcopy(runner.planner.stats) if runner.planner is not None else None,
        )

    @classmethod
    def merge(cls, per_rank: Sequence["RankCounters"]) -> "RankCounters":
        """All ranks as one: sums (the planners' counters too), but the fullest rank's KV usage
        and each pipeline stage's mean idle fraction."""
        total = cls(kv_usage=max((c.kv_usage for c in per_rank), default=0.0))
        for c in per_rank:
            total.waiting += c.waiting
            total.running += c.running
            total.steps += c.steps
            total.ubatched_steps += c.ubatched_steps
            total.ubatch_yields += c.ubatch_yields
            total.step_time_s += c.step_time_s
            total.forward_busy_s += c.forward_busy_s
            total.prompt_tokens += c.prompt_tokens
            total.generated_tokens += c.generated_tokens
            total.preemptions += c.preemptions
            total.times = total.times + c.times
            total.failed_steps += c.failed_steps
            if c.planner is not None:
                total.planner = c.planner if total.planner is None else total.planner + c.planner
        stages = [c.pipeline_stage_idle_fraction for c in per_rank if c.pipeline_stage_idle_fraction]
        if stages:
            total.pipeline_stage_idle_fraction = [sum(column) / len(stages) for column in zip(*stages)]
        return total


__all__ = ["RankCounters"]
