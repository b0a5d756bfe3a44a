"""The overlap planners a rank keeps, one per overlap setting, and how a measured step is fed
back to the one that chose its overlap. The model runner and the benchmark's MoE stack (which
has no runner) both keep theirs here, so a benchmark that swaps settings per mode gets back
each setting's planner, with what it learnt, exactly as the runtime would.

An `auto` planner starts from the prior its config names: the `--thresholds-file`, else the
simulated document the command put in the config (`OverlapConfig.simulated_prior`)."""

from __future__ import annotations

from tandem.config import OverlapConfig
from tandem.contexts import StepTimes
from tandem.ubatch.planner import OverlapPlanner, PlannedStep, StepMeasurement, StepShape, TunePrior, overlap_choices


class PlannerCache:
    def __init__(self) -> None:
        self._planners: dict[tuple, OverlapPlanner] = {}
        #: The simulated documents the planners were keyed by (their id), held so no other
        #: document can take the id of one while its planner is cached.
        self._documents: dict[int, dict] = {}

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
        # The simulated prior by identity: hashing its content would cost every step.
        document = id(o.simulated_prior) if o.simulated_prior is not None else None
        key = (auto, o.num_ubatches, o.enable_dbo, sbo, o.thresholds_file, document, o.planner_explore_share, hides)
        if key not in self._planners:
            self._planners[key] = OverlapPlanner(
                overlap_choices(o.num_ubatches, dbo=o.enable_dbo and hides, sbo=sbo and hides),
                explore_share=o.planner_explore_share if auto else 0.0,
                prior=starting_prior(o) if auto else None,
            )
            if document is not None:
                self._documents[document] = o.simulated_prior
        return self._planners[key]


def starting_prior(overlap: OverlapConfig) -> TunePrior | None:
    """The prior an `auto` planner of `overlap` starts from: the thresholds file's sweep, else
    the simulated document's, else none."""
    if overlap.thresholds_file:
        return TunePrior.from_file(overlap.thresholds_file)
    if overlap.simulated_prior is not None:
        return TunePrior.from_document(overlap.simulated_prior, "the simulated prior")
    return None


def prior_source(overlap: OverlapConfig) -> str | None:
    """Where the prior of `overlap` comes from, in words (None: it has none)."""
    if overlap.thresholds_file:
        return f"the tune file {overlap.thresholds_file}"
    if overlap.simulated_prior is not None:
        simulated = overlap.simulated_prior["config"]["simulated"]
        return f"simulated on {simulated['hardware']} for {simulated['model']} on {simulated['ranks']} ranks"
    return None


def describe_prior(planner: OverlapPlanner | None, overlap: OverlapConfig) -> str | None:
    """The start-up line of what an `auto` planner starts from: the prior it holds, by phase,
    and where it came from; None when no `auto` planner runs."""
    if planner is None or overlap.overlap_policy != "auto":
        return None
    prior = planner.prior
    if prior is None or not any(prior.tables.values()):
        return "the overlap planner starts with no prior (the static thresholds until it has measured)"
    phases = ", ".join(
        f"{phase} {len(rows)} sizes ({rows[0][0]}-{rows[-1][0]} tokens)" for phase, rows in prior.tables.items() if rows
    )
    return f"the overlap planner starts from a prior {prior_source(overlap)}: {phases}"


def observe_step(planner: OverlapPlanner, planned: PlannedStep | None, shape: StepShape, times: StepTimes) -> None:
    """Feed a step's time model back to the planner that chose its overlap (`planned`; None:
    no planner chose it, nothing to learn)."""
    if planned is not None:
        planner.observe(planned, shape, StepMeasurement(times.step_s, times.compute_s, times.comm_s, times.switch_s))


__all__ = ["PlannerCache", "describe_prior", "observe_step", "prior_source", "starting_prior"]
