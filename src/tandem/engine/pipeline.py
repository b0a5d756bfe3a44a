"""Pipeline parallelism: P stage processes, several micro-batches in flight (SGLang's
`event_loop_pp` semantics).

The first stage owns the scheduler. Each `PipelineEngine.step()` first, when S micro-batches
are in flight (S = P + async depth), receives the sampled ids of the oldest one from the last
stage and applies them (stop checks, detokenization, freeing KV); then it plans the next
micro-batch (a scheduler step capped to about 1/S of the live requests, skipping requests
whose sampled token is still in flight), runs the stage's layers on it, sends the hidden
states on with an asynchronous send and returns. So the ring stays full between steps: the
later stages work while the first stage's caller hands the outputs to the front end (with
S = 1 too, where the stages otherwise take turns).

Every stage learns a micro-batch's requests by *forwarding*: the plan (request ids, the
padded size and the ubatch decision the first stage's DP group agreed on) and the step inputs
the first stage built (positions, KV slots and block table) travel in the tensor dict that
carries the hidden states (`stage_handoff`). No stage schedules or allocates: every stage has
a KV cache of the same block count for its own layers and writes the blocks the first stage
chose. Micro-batches flow in order through every stage, so a block freed and reused by a
later micro-batch is always written after the earlier one read it, and successive chunks of
one prompt can ride back-to-back micro-batches (chunked pipeline prefill).

The last stage samples with per-request parameters and samplers it keeps in `SamplingStates`,
the engine's own home for them (announced with the request's first micro-batch, dropped when
the first stage reports it finished; the first stage keeps none) and sends
the ids back to the first stage, with only the outcome and the stages' counters (the first
stage kept the plan). Every transfer is one message into a receive posted in advance
(`tandem.distributed.StageLink`). `pipeline_choice.choose_micro_batches` measures at start-up
whether the micro-batch ring beats one micro-batch in flight (it does not on a model whose step
costs the same whatever its size) and keeps the faster. A stage whose forward raises passes the error on instead
of hidden states; the first stage fails that micro-batch's requests and goes on. A dead
stage breaks the links: its neighbours' transfers fail (or time out after the step
timeout), they exit, and the front end reports the engine unavailable. While idle the first
stage sends heartbeats down the pipeline so an idle stage's bounded receive never expires.

Send buffers are released only when a micro-batch's results came back around the ring (the
first stage) or S sends later (the other stages), when the receiver has surely read them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque

import torch

from tandem.config import SchedulerConfig
from tandem.distributed import StageGroups, StageLinkError
from tandem.engine.core import DEFAULT_STEP_TIMEOUT_S, Engine, RankCounters
from tandem.worker.model_runner import ModelRunner, StepResult
from tandem.worker.sampling import SamplingParams
from tandem.engine.scheduler import SchedulerStep
from tandem.engine.outputs import RequestOutput
from tandem.engine.stage_handoff import (
    HEARTBEAT, STEP, STOP, MicroBatchPlan, MicroBatchResult, SamplingAnnouncer, StageCounters, input_tensors,
    learn_sampling, prompts_to_announce, pack_inputs,
)
from tandem.engine.stage_worker import StageWorker
from tandem.worker.sampling_states import SamplingStates

#: How often an idle first stage tells the others it is alive.
HEARTBEAT_INTERVAL_S = 1.0


class PipelineEngine(Engine):
    """The first stage's loop: an `Engine` whose steps are micro-batches in a ring of
    `num_micro_batches` (P + async depth; 1 is the no-overlap baseline)."""

    def __init__(
        self,
        runner: ModelRunner,
        groups: StageGroups,
        scheduler: SchedulerConfig | None = None,
        *,
        num_micro_batches: int,
        max_num_batched_tokens: int | None = None,
        lockstep: bool = False,
    ):
        if num_micro_batches < 1:
            raise ValueError(f"the pipeline needs at least one micro-batch in flight, got {num_micro_batches}")
        # The micro-batch ring is the overlap: the scheduler's own overlapped loop stays off.
        scheduler = dataclasses.replace(scheduler or SchedulerConfig(), overlap_schedule=False)
        super().__init__(runner, scheduler, max_num_batched_tokens=max_num_batched_tokens, lockstep=lockstep)
        self.sampling = None  # the last stage samples and keeps them (`run_stage`)
        self.worker = StageWorker(runner, groups, timeout_s=self.step_timeout_s)
        if not self.worker.is_first:
            raise ValueError("PipelineEngine runs on the first pipeline stage; later stages run run_stage()")
        self.num_micro_batches = num_micro_batches
        self._in_flight: deque[tuple[SchedulerStep, MicroBatchPlan, object]] = deque()
        self._finished: list[str] = []
        self._announcer = SamplingAnnouncer()
        self._last_send = time.monotonic()
        #: stage -> that stage's latest counters (this stage's own under index 0).
        self.stage_stats: dict[int, StageCounters] = {}
        self._closed = False
        #: Set while `choose_micro_batches` measures: its micro-batches are marked as probes.
        self.probing = False

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished or any(step.scheduled for step, _, _ in self._in_flight)

    @property
    def micro_batches_in_flight(self) -> int:
        return len(self._in_flight)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestOutput | None:
        if params.json_schema is not None:
            # The last stage samples, away from the first stage's scheduler where grammars live.
            return RequestOutput.failed(request_id, "structured output (a JSON schema constraint) is not supported "
                                                    "with pipeline parallelism yet")
        return super().add_request(request_id, prompt_ids, params)

    def abort(self, request_id: str) -> RequestOutput | None:
        output = super().abort(request_id)
        if output is not None:
            self._finished.append(request_id)
        return output

    def step(self) -> list[RequestOutput]:
        """Retire the oldest micro-batch if the ring is full, then launch the next one and
        return without waiting for it: the ring stays full *between* steps, so the later
        stages work while this stage's caller hands the outputs on."""
        outputs: list[RequestOutput] = []
        retired = len(self._in_flight) >= self.num_micro_batches
        if retired:
            outputs += self._retire_oldest()
        live = len(self.scheduler.running) + len(self.scheduler.waiting)
        planned = self.scheduler.schedule(
            max_requests=max(1, math.ceil(live / self.num_micro_batches)), skip_in_flight=True
        )
        if planned.scheduled or self.lockstep:  # DP peers of a stage run every micro-batch together
            self._launch(planned)
        elif self._in_flight and not retired:
            outputs += self._retire_oldest()  # nothing new to run: wait for the oldest results
        return outputs

    def drain(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self._in_flight:
            outputs += self._retire_oldest()
        return outputs

    def _launch(self, planned: SchedulerStep) -> None:
        worker = self.worker
        chunks = [entry.chunk for entry in planned.scheduled]
        request_ids = [entry.request.request_id for entry in planned.scheduled]
        self._announcer.forget(self._finished)  # before `new`: an id used again is announced again
        new_sampling = self._announcer.new(request_ids, [entry.request.params for entry in planned.scheduled])
        plan = MicroBatchPlan(
            request_ids=request_ids,
            new_sampling=new_sampling,
            new_prompts=prompts_to_announce(new_sampling, request_ids, [e.request.prompt_ids for e in planned.scheduled]),
            samples=[entry.slot is not None for entry in planned.scheduled],
            finished_ids=self._finished,
            probe=self.probing,
        )
        self._finished = []
        start = time.perf_counter()
        inputs: dict = {}
        try:
            hidden, plan.step, built = worker.forward_first(chunks, self.probing)
            inputs = pack_inputs(plan, built)
        except Exception as exc:  # noqa: BLE001 - the micro-batch's requests fail, the pipeline goes on
            plan.error = f"stage 0: {type(exc).__name__}: {exc}"
            hidden = torch.empty(0, dtype=worker.dtype, device=worker.device)
        worker.counters.busy_s += time.perf_counter() - start
        worker.counters.micro_batches += 1
        self.forward_busy_s += time.perf_counter() - start
        message = {"plan": plan, "hidden": hidden, **inputs}
        self._in_flight.append((planned, plan, worker.send(message, worker.next_rank)))
        worker.expect(worker.prev_rank)  # its results will come back: be ready for them
        self._last_send = time.monotonic()

    def _retire_oldest(self) -> list[RequestOutput]:
        outputs = self._retire()
        self._finished += [o.request_id for o in outputs if o.finished]
        return outputs

    def _retire(self) -> list[RequestOutput]:
        planned, plan, send = self._in_flight.popleft()
        worker = self.worker
        start = time.perf_counter()
        try:
            message = worker.recv(worker.prev_rank)
        except StageLinkError as exc:
            last = worker.topology.pipeline_parallel_size - 1
            raise StageLinkError(
                f"pipeline stage {last} ({worker.topology.describe(worker.prev_rank)}) returned no results within "
                f"{self.step_timeout_s:g} s: it, or a stage before it, is dead or hung ({exc})"
            ) from exc
        waited = time.perf_counter() - start
        worker.counters.idle_s += waited
        if self._in_flight:
            worker.expect(worker.prev_rank)
        send.wait(self.step_timeout_s)  # the micro-batch came back: every stage has read its inputs
        result: MicroBatchResult = message["result"]
        self.stage_stats.update(result.stage_stats)
        self.stage_stats[0] = dataclasses.replace(worker.counters)
        if result.error is not None:
            return self._fail(planned, RuntimeError(result.error))
        tokens = [int(t) if t >= 0 else None for t in message["tokens"].tolist()]
        return self._apply(planned, StepResult(tokens, 0, plan.step.num_tokens_padded, plan.step.ubatched))

    def idle(self) -> None:
        if self._in_flight or time.monotonic() - self._last_send < HEARTBEAT_INTERVAL_S:
            return
        self.heartbeat()

    def heartbeat(self) -> None:
        """Tell the later stages the pipeline is alive and idle (their next wait is no bubble).
        Sent only with nothing in flight, so the next stage is waiting for it: completed here."""
        self.worker.send({"plan": MicroBatchPlan(kind=HEARTBEAT)}, self.worker.next_rank).wait(self.step_timeout_s)
        self._last_send = time.monotonic()

    def control_plane(self, world_size: int):
        """The first stage's DP ranks keep the control plane among themselves."""
        size = self.worker.topology.data_parallel_size
        return (self.worker.groups.first_stage_cpu_group if size > 1 else None), size

    def trace_group(self, control):
        """Every stage's timeline, gathered over all ranks (the later stages join once `close`
        has told them to stop)."""
        from tandem.distributed.launch import cpu_group

        return cpu_group()

    def my_prompts(self, prompts: list, rank: int, world_size: int) -> list:
        groups = self.worker.groups
        return super().my_prompts(prompts, groups.dp_rank, groups.topology.data_parallel_size)

    def keeps_going(self) -> bool:
        return any_first_stage_rank(self.worker.groups, self.has_work)

    def stats(self) -> RankCounters:
        stats = super().stats()
        stats.pipeline_stage_idle_fraction = [
            self.stage_stats.get(s, StageCounters()).idle_fraction for s in range(self.worker.topology.pipeline_parallel_size)
        ]
        return stats

    def close(self) -> None:
        """Finish what is in flight and stop the later stages."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        self.worker.send({"plan": MicroBatchPlan(kind=STOP)}, self.worker.next_rank).wait(self.step_timeout_s)


def run_stage(runner: ModelRunner, groups: StageGroups, *, num_micro_batches: int,
              step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S, on_message=None) -> StageCounters:
    """The loop of a stage after the first: receive a micro-batch, run the stage's layers,
    send the hidden states on (the last stage: sample and send the ids back to the first
    stage), until the first stage says stop. `on_message()` is called on every message
    (a watchdog beat). Returns the stage's counters."""
    worker = StageWorker(runner, groups, timeout_s=step_timeout_s)
    if worker.is_first:
        raise ValueError("run_stage runs the stages after the first; the first runs a PipelineEngine")
    # The last stage samples: it keeps the sampling states the first stage's engine would.
    sampling = SamplingStates(runner.info.eos_token_ids) if worker.is_last else None
    pending: deque = deque()
    counters = worker.counters
    previous_was_step = False
    while True:
        start = time.perf_counter()
        message = worker.recv(worker.prev_rank)
        waited = time.perf_counter() - start
        if on_message is not None:
            on_message()
        plan: MicroBatchPlan = message["plan"]
        if plan.kind != STOP:
            worker.expect(worker.prev_rank)  # the first stage sends until it says stop
        if plan.kind != STEP:
            previous_was_step = False
            if not worker.is_last:
                pending.append(worker.send(message, worker.next_rank))
            if plan.kind == STOP:
                break
            continue
        if previous_was_step:
            counters.idle_s += waited
        previous_was_step = True
        start = time.perf_counter()
        out = _run_micro_batch(worker, plan, message, sampling)
        counters.busy_s += time.perf_counter() - start
        counters.micro_batches += 1
        plan.stage_stats[worker.stage] = dataclasses.replace(counters)
        if worker.is_last:  # the first stage kept the plan: send back only the outcome
            out = {"result": MicroBatchResult(plan.error, plan.stage_stats), "tokens": out["tokens"]}
        pending.append(worker.send(out, worker.next_rank))
        while len(pending) > num_micro_batches:
            pending.popleft().wait(step_timeout_s)
    for send in pending:
        send.wait(step_timeout_s)
    return counters


def _run_micro_batch(worker: StageWorker, plan: MicroBatchPlan, message: dict, sampling: SamplingStates | None) -> dict:
    """One later stage's work on a micro-batch: its layers, then (last stage) sampling; an
    error goes on in the plan instead of hidden states."""
    if sampling is not None:
        learn_sampling(sampling, plan)  # also for a failed micro-batch: its requests' drops will come
    if plan.error is None:
        try:
            hidden, inputs = worker.forward_later(plan, message)
            if sampling is not None:
                return {"plan": plan, "tokens": _sample(worker, plan, hidden, inputs, sampling)}
            return {"plan": plan, "hidden": hidden, **input_tensors(message)}
        except Exception as exc:  # noqa: BLE001 - reported to the first stage, which fails the requests
            plan.error = f"stage {worker.stage}: {type(exc).__name__}: {exc}"
    return {"plan": plan, "hidden" if sampling is None else "tokens": torch.empty(0, dtype=torch.int64)}


def _sample(worker: StageWorker, plan: MicroBatchPlan, hidden, inputs, sampling: SamplingStates) -> torch.Tensor:
    if plan.num_requests == 0:
        return torch.empty(0, dtype=torch.int64)
    params, samplers = sampling.for_requests(plan.request_ids)
    tokens = worker.runner.sample_tokens(hidden, inputs, params, samplers, plan.samples)
    return torch.tensor([-1 if t is None else t for t in tokens], dtype=torch.int64)


def any_first_stage_rank(groups: StageGroups, flag: bool) -> bool:
    """Whether `flag` holds on any rank of the first stage (one small gloo all-reduce)."""
    import torch.distributed as dist

    if groups.topology.data_parallel_size == 1:
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=groups.first_stage_cpu_group)
    return bool(value.item())


__all__ = [
    "MicroBatchPlan",
    "MicroBatchResult",
    "PipelineEngine",
    "StageCounters",
    "StageWorker",
    "run_stage",
]
