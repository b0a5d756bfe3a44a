"""`RankCounters`: one rank's engine counters, typed from the step that measures them to the
front end that exports them. Ranks send them as they are; the front end merges them
(`RankCounters.merge`) into the one set `/metrics` reads. The time model travels as one
`StepTimes`, the type the model runner measures a step in, never renamed on the way."""

from __future__ import annotations

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
