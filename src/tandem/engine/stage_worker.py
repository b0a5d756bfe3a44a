"""`StageWorker`: one pipeline stage's model work on a micro-batch and its links to the
neighbouring stages. The first stage's `PipelineEngine` and the later stages' `run_stage`
(`pipeline.py`, which describes the ring) both run their micro-batches through one."""

from __future__ import annotations

import torch

from tandem.distributed import StageGroups, StageLink
from tandem.engine.core import DEFAULT_STEP_TIMEOUT_S
from tandem.engine.stage_handoff import MicroBatchPlan, StageCounters, unpack_inputs
from tandem.worker.model_runner import ModelRunner
from tandem.worker.step_inputs import ScheduledChunk


class StageWorker:
    """One stage's model work on a micro-batch, on top of a `ModelRunner` whose model holds
    only the stage's layers."""

    def __init__(self, runner: ModelRunner, groups: StageGroups, *, timeout_s: float = DEFAULT_STEP_TIMEOUT_S):
        self.runner = runner
        self.groups = groups
        self.topology = groups.topology
        self.rank = groups.rank
        self.stage = groups.stage
        self.is_first = self.topology.is_first_stage(self.rank)
        self.is_last = self.topology.is_last_stage(self.rank)
        self.next_rank = self.topology.next_rank(self.rank)
        self.prev_rank = self.topology.prev_rank(self.rank)
        self.timeout_s = timeout_s
        self.counters = StageCounters()
        self.device = next(iter(runner.model.parameters())).device
        self.hidden_size = int(runner.model.config.hidden_size)
        self.dtype = runner.model.dtype
        self._links: dict[int, StageLink] = {}

    # -- transfers ------------------------------------------------------------------------

    def link(self, peer: int) -> StageLink:
        """The link to `peer` (one per peer: with two stages the next rank is the previous one)."""
        if peer not in self._links:
            self._links[peer] = StageLink(peer, cpu_group=self.groups.cpu_group, device_group=self.groups.device_group,
                                          device=self.device)
        return self._links[peer]

    def send(self, data: dict, dst: int):
        return self.link(dst).send(data)

    def expect(self, src: int) -> None:
        """Post the receive of the next message from `src` before it is sent."""
        self.link(src).expect()

    def recv(self, src: int) -> dict:
        return self.link(src).recv(self.timeout_s)

    # -- compute --------------------------------------------------------------------------

    @torch.no_grad()
    def forward_first(self, chunks: list[ScheduledChunk], probe: bool = False):
        """Embed and run the first stage's layers. The step is planned here, with the stage's
        other DP ranks; its `StepPlan` and built inputs are forwarded to the later stages.
        Returns the hidden states, the plan and the inputs (None when the step is empty)."""
        runner = self.runner
        step = runner.plan_step(chunks)
        if step.num_tokens_padded == 0:
            return torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device), step, None
        inputs = runner.step_inputs(chunks, step)
        return runner.forward(inputs.input_ids, inputs, step, count=not probe), step, inputs

    @torch.no_grad()
    def forward_later(self, plan: MicroBatchPlan, message: dict):
        """Run this stage's layers on the previous stage's hidden states with the inputs the
        first stage built; returns the hidden states and the inputs (the last stage samples
        from both)."""
        hidden = message["hidden"]
        if plan.step.num_tokens_padded == 0:
            return hidden, None
        inputs = unpack_inputs(plan, message)
        return self.runner.forward(hidden, inputs, plan.step, count=not plan.probe), inputs


__all__ = ["StageWorker"]
