"""The overlap planners a rank keeps, one per overlap setting, and how a measured step is fed
back to the one that chose its overlap. The model runner and the benchmark's MoE stack (which
has no runner) both keep theirs here, so a benchmark that swaps settings per mode gets back
each setting's planner, with what it learnt, exactly as the runtime would."""

from __future__ import annotations

from tandem.config import OverlapConfig
from tandem.contexts import StepTimes
from tandem.ubatch.planner import OverlapPlanner, PlannedStep, StepMeasurement, StepShape, TunePrior, overlap_choices


class PlannerCache:
    def __init__(self) -> None:
        self._planners: dict[tuple, OverlapPlanner] = {}

    def planner(self, overlap: OverlapConfig, *, sbo: bool, moves_tokens: bool = True) -> OverlapPlanner | None:
        """The planner of `overlap` under `--overlap-policy auto`; under `--ubatch-split
        balanced-cost` too, where it only observes (its fit prices attention for the cut).
        `sbo`: whether the MoE kernels can run single-batch overlap (a choice it weighs).
        `moves_tokens`: whether any MoE layer's dispatch and combine move tokens."""
        o = overlap
        if o.overlap_policy != "auto" and o.ubatch_split != "balanced-cost":
            return None
        auto = o.overlap_policy == "auto"
        # Where no MoE layer moves tokens (one rank, `local` dispatch, no modelled fabric) there
        # is nothing to hide: DBO and SBO could only add their overhead, so auto picks none. (A
        # planner that only observes keeps every choice: the static rule decides.)
        hides = moves_tokens or not auto
        key = (auto, o.num_ubatches, o.enable_dbo, sbo, o.thresholds_file, o.planner_explore_share, hides)
        if key not in self._planners:
            self._planners[key] = OverlapPlanner(
                overlap_choices(o.num_ubatches, dbo=o.enable_dbo and hides, sbo=sbo and hides),
                explore_share=o.planner_explore_share if auto else 0.0,
                prior=TunePrior.from_file(o.thresholds_file) if auto and o.thresholds_file else None,
            )
        return self._planners[key]


def observe_step(planner: OverlapPlanner, planned: PlannedStep | None, shape: StepShape, times: StepTimes) -> None:
    """Feed a step's time model back to the planner that chose its overlap (`planned`; None:
    no planner chose it, nothing to learn)."""
    if planned is not None:
        planner.observe(planned, shape, StepMeasurement(times.step_s, times.compute_s, times.comm_s, times.switch_s))


__all__ = ["PlannerCache", "observe_step"]
