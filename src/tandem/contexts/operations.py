"""Operations (TBO): a forward written as a list of operations cut into stages by
`YieldOperation`, and executors that run one list alone or interleave several ubatches
stage by stage on the caller's thread (SGLang's two-batch overlap: no threads, no switches).

An operation is `fn(state, **inputs) -> dict`: `inputs` are the previous operation's output
(the first operation gets the ubatch's inputs), `state` is a dict private to the
ubatch that lives across its stages (where an operation leaves what a later stage
needs, e.g. an all-to-all in flight). A stage is the run of operations between two yields.

`execute_overlapped_operations` starts ubatch i once ubatch 0 has run
`delta_stages[i]` stages, then runs one stage of every started, unfinished ubatch per
round, in ubatch order. For two ubatches and `delta_stages=[0, d]` that is
SGLang's order: A runs d stages alone, then A and B alternate, then B runs its last d.
`execute_operations` runs one list alone; inside a thread or greenlet ubatch its yields
are `dbo_yield`s, so the same operation list serves all three executors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

from tandem.contexts.dbo import dbo_yield
from tandem.contexts.forward_context import set_forward_context
from tandem.contexts.ubatch_context import _CURRENT_STAGE_UBATCH


class YieldOperation:
    """A stage boundary: under the stage executor another ubatch runs here."""

    def __repr__(self) -> str:
        return "YieldOperation()"


@dataclass(frozen=True)
class ExecutionOperation:
    debug_name: str
    fn: Callable[..., dict | None]


Operation = Union[YieldOperation, ExecutionOperation, Callable[..., Any]]
Stage = list[ExecutionOperation]


@dataclass(frozen=True)
class OperationsStrategy:
    """A layer's (or a stack's) operations and the stage offset its second ubatch
    starts at (SGLang's `tbo_delta_stages`)."""

    operations: list = field(default_factory=list)
    delta_stages: int = 0

    @classmethod
    def concat(cls, strategies: Sequence["OperationsStrategy"]) -> "OperationsStrategy":
        deltas = {s.delta_stages for s in strategies}
        if len(deltas) > 1:
            raise ValueError(f"cannot concatenate strategies with different delta_stages {sorted(deltas)}")
        return cls([op for s in strategies for op in s.operations], deltas.pop() if deltas else 0)


def _as_operation(op: Operation, position: int) -> YieldOperation | ExecutionOperation:
    if isinstance(op, (YieldOperation, ExecutionOperation)):
        return op
    if callable(op):
        name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or type(op).__name__
        return ExecutionOperation(name, op)
    raise TypeError(f"operation {position} is {op!r}: expected a YieldOperation, an ExecutionOperation or a callable")


def to_stages(operations: Sequence[Operation]) -> list[Stage]:
    """The stages of an operation list; a trailing yield ends the last stage."""
    stages: list[Stage] = [[]]
    for position, raw in enumerate(operations):
        op = _as_operation(raw, position)
        if isinstance(op, YieldOperation):
            if not stages[-1]:
                raise ValueError(f"operation {position} is a YieldOperation that would leave an empty stage")
            stages.append([])
        else:
            stages[-1].append(op)
    if not stages[-1]:
        stages.pop()
    if not stages:
        raise ValueError("an operation list needs at least one operation")
    return stages


class _StagedUBatch:
    """One ubatch's progress through its stages."""

    def __init__(self, index: int, stages: list[Stage], inputs: dict, forward_context: Any, *, overlapped: bool):
        self.index = index
        self.overlapped = overlapped
        self.stages = stages
        self.next_stage = 0
        self.state: dict = {}
        self.output: dict | None = inputs
        self.forward_context = forward_context

    @property
    def done(self) -> bool:
        return self.next_stage >= len(self.stages)

    def run_stage(self) -> None:
        stage_index = self.next_stage
        scope = (
            set_forward_context(self.forward_context) if self.forward_context is not None else contextlib.nullcontext()
        )
        # A list run alone inside an overlapped stage keeps that stage's ubatch id.
        token = _CURRENT_STAGE_UBATCH.set(self.index) if self.overlapped else None
        try:
            with scope:
                for op in self.stages[stage_index]:
                    try:
                        self.output = op.fn(self.state, **(self.output or {}))
                    except BaseException as exc:
                        where = f"stage {stage_index} ({op.debug_name})"
                        note = f"in ubatch {self.index}, {where}" if self.overlapped else f"in {where}"
                        if hasattr(exc, "add_note"):
                            exc.add_note(note)
                        raise
        finally:
            if token is not None:
                _CURRENT_STAGE_UBATCH.reset(token)
        self.next_stage += 1


def execute_operations(inputs: dict, operations: Sequence[Operation], *, forward_context: Any = None) -> dict:
    """Run `operations` on `inputs` alone. Inside a DBO ubatch (thread or greenlet
    executor) each yield is a `dbo_yield`, so one operation list runs under every executor;
    elsewhere yields only separate stages."""
    batch = _StagedUBatch(0, to_stages(operations), inputs, forward_context, overlapped=False)
    batch.run_stage()
    while not batch.done:
        dbo_yield()
        batch.run_stage()
    return batch.output if batch.output is not None else {}


class StageExecutor:
    """Interleaves ubatches stage by stage on the caller's thread.

    The third executor next to `ThreadExecutor` and `GreenletExecutor`, with the counters
    the runner reads (`runs`, `switches`, `switch_time_s`, always 0: a switch is a loop step)."""

    kind = "stages"
    runs_operations = True

    def __init__(self) -> None:
        self.runs = 0
        self.switches = 0
        self.switch_time_s = 0.0

    def run(
        self,
        inputs_arr: Sequence[dict],
        operations_arr: Sequence[Sequence[Operation]],
        delta_stages: Sequence[int],
        *,
        forward_contexts: Sequence[Any] | None = None,
    ) -> list[dict]:
        n = len(inputs_arr)
        if n < 2:
            raise ValueError(f"execute_overlapped_operations needs at least 2 ubatches, got {n}")
        if len(operations_arr) != n or len(delta_stages) != n:
            raise ValueError(
                f"got {n} inputs, {len(operations_arr)} operation lists and {len(delta_stages)} delta_stages: "
                "give one of each per ubatch"
            )
        if forward_contexts is not None and len(forward_contexts) != n:
            raise ValueError(f"got {len(forward_contexts)} forward contexts for {n} ubatches")
        if delta_stages[0] != 0:
            raise ValueError(f"delta_stages[0] must be 0 (ubatch 0 starts first), got {delta_stages[0]}")
        batches = [
            _StagedUBatch(
                i, to_stages(ops), dict(inputs), None if forward_contexts is None else forward_contexts[i], overlapped=True
            )
            for i, (inputs, ops) in enumerate(zip(inputs_arr, operations_arr))
        ]
        first_stages = len(batches[0].stages)
        for i, delta in enumerate(delta_stages):
            if not 0 <= delta <= first_stages:
                raise ValueError(
                    f"delta_stages[{i}]={delta} is outside [0, {first_stages}] (ubatch 0 has {first_stages} stages)"
                )
        self.runs += 1
        previous = None
        while not all(b.done for b in batches):
            # Who runs this round is decided before it starts: a ubatch that becomes
            # eligible during the round joins at the next, after ubatch 0's turn.
            ready = [b for b, delta in zip(batches, delta_stages) if batches[0].next_stage >= delta and not b.done]
            for batch in ready:
                batch.run_stage()
                self.switches += previous is not None and previous != batch.index
                previous = batch.index
        return [b.output if b.output is not None else {} for b in batches]


def execute_overlapped_operations(
    inputs_arr: Sequence[dict],
    operations_arr: Sequence[Sequence[Operation]],
    delta_stages: Sequence[int],
    *,
    forward_contexts: Sequence[Any] | None = None,
) -> list[dict]:
    """Run ubatch i's `operations_arr[i]` on `inputs_arr[i]`, interleaved stage by
    stage (see the module docstring); `forward_contexts[i]`, when given, is the forward
    context current while ubatch i's stages run. Returns the outputs in order."""
    return StageExecutor().run(inputs_arr, operations_arr, delta_stages, forward_contexts=forward_contexts)


__all__ = [
    "ExecutionOperation",
    "Operation",
    "OperationsStrategy",
    "StageExecutor",
    "YieldOperation",
    "execute_operations",
    "execute_overlapped_operations",
    "to_stages",
]
