"""`StepPlan`: what one step runs, decided once and then passed, unchanged, to everything
that runs or learns from the step.

Planning (`ModelRunner.plan_step`) agrees with the other DP ranks on the padded size and
the overlap choice, cuts the ubatches and returns a frozen `StepPlan`; running the forward
(`ModelRunner.forward`, a pipeline stage) and observing the measured step
(`ModelRunner.observe`) take that value. A pipeline's first stage forwards it to the later
stages, so every stage splits the same way. `decide_overlap` is the decision itself, shared
with the benchmark's MoE stack, which has no runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.config import OverlapConfig
from tandem.contexts import ForwardContext, timed_blocking
from tandem.ubatch import UBatchDecision, UBatchSlice, check_ubatch_thresholds, coordinate_ubatching
from tandem.ubatch.planner import OverlapPlanner, PlannedStep, StepShape

@dataclass(frozen=True)
class StepPlan:
    #: This rank's scheduled tokens, and what it runs after padding (0: every DP rank is idle).
    num_tokens: int
    num_tokens_padded: int
    #: The ubatch cut, or None when the step runs unsplit.
    ubatch_slices: tuple[UBatchSlice, ...] | None = None
    #: TBO (the stages executor) only: SGLang's decode strategy (True) or prefill strategy
    #: (False), agreed by the DP ranks because the two issue their all-to-alls in different
    #: orders; None for the other executors.
    tbo_decode: bool | None = None
    #: The step's single-batch overlap: on, off, or None to leave each MoE kernel its own
    #: `enable_sbo` (a kernel used outside a runner).
    sbo: bool | None = None
    #: The overlap planner's choice and the shape it priced, which `observe` feeds back;
    #: None when no planner runs or the rank is idle (nothing to learn from waiting).
    planned: PlannedStep | None = None
    shape: StepShape | None = None

    @property
    def num_ubatches(self) -> int:
        return len(self.ubatch_slices) if self.ubatch_slices else 1

    @property
    def ubatched(self) -> bool:
        return self.ubatch_slices is not None

    def forward_context(self, attn_metadata: Any) -> ForwardContext:
        """The forward context the step's model code reads."""
        slices = list(self.ubatch_slices) if self.ubatch_slices else None
        return ForwardContext(attn_metadata=attn_metadata, ubatch_slices=slices, tbo_decode=self.tbo_decode, sbo=self.sbo)


def decide_overlap(
    overlap: OverlapConfig,
    planner: OverlapPlanner | None,
    shape: StepShape,
    *,
    group=None,
    prefills: bool = False,
) -> tuple[UBatchDecision, PlannedStep | None, int]:
    """The step's overlap decision, agreed with the other ranks of `group` in one
    all-reduce: the static thresholds say whether this rank wants ubatches; under
    `--overlap-policy auto` the planner's predictions ride along and it picks the choice
    whose slowest rank is fastest. Returns the agreed decision, the planner's choice (None
    without a planner; the static rule's choice when the planner only observes) and the
    number of ubatches the step runs (1: unsplit)."""
    wants = overlap.enable_dbo and check_ubatch_thresholds(
        shape.num_tokens, shape.decode, overlap.dbo_decode_token_threshold, overlap.dbo_prefill_token_threshold
    )
    predicted = planner.predict(shape) if planner is not None and overlap.overlap_policy == "auto" else None
    with timed_blocking():
        decision = coordinate_ubatching(
            shape.num_tokens, wants, group=group, num_ubatches=overlap.num_ubatches, predicted_s=predicted,
            prefills=prefills,
        )
    static_num_ubatches = overlap.num_ubatches if decision.should_ubatch else 1
    if planner is None:
        return decision, None, static_num_ubatches
    if predicted is None:  # a static policy: the planner only learns
        static = planner.static_choice(static_num_ubatches)
        planned = PlannedStep(static, planner.predict(shape)[planner.choices.index(static)], False)
    else:
        planned = planner.decide(decision, static_num_ubatches, predicted)
    return decision, planned, planned.choice.num_ubatches


__all__ = ["StepPlan", "decide_overlap"]
