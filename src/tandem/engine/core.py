"""`Engine`: one rank's serving loop, scheduler + model runner, in one of two shapes.

- normal: schedule step N → run its forward → apply its tokens.
- overlap (default): schedule step N and hand it to the forward worker thread, then apply
  step N-1's tokens (stop checks, detokenization, freeing KV) while N runs. Step N's inputs
  name N-1's not-yet-known tokens by `FutureMap` placeholders. The worker runs steps one
  at a time in order, so the pipeline is exactly one step deep.

Both shapes give the same tokens for the same seeds: a request's sampling stream is its own
generator, and a request that finished at step N-1 but was already planned into step N
only has its late token dropped.

With `lockstep=True` (several DP ranks) every `step()` runs one forward even when this
rank has nothing scheduled: the MoE all-to-alls span all ranks, so an idle rank joins with
a dummy batch. The caller must call `step()` on every rank or on none: the rank loop steps
all ranks while any rank `has_work`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from tandem.config import EngineConfig, SchedulerConfig
from tandem.models.hf_config import config_value
from tandem.platform.device import available_cores
from tandem.worker.future_map import FutureMap
from tandem.worker.model_runner import ModelRunner, StepResult
from tandem.worker.sampling import SamplingParams
from tandem.engine.scheduler import Request, Scheduler, SchedulerStep
from tandem.worker.grammar import GrammarCompiler, advance_constraints
from tandem.worker.sampling_states import SamplingStates
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.counters import RankCounters
from tandem.engine.outputs import Completion, RequestOutput

#: How long the scheduler waits for a forward before declaring the engine stuck.
DEFAULT_STEP_TIMEOUT_S = SchedulerConfig.step_timeout_s


class StepTimeoutError(RuntimeError):
    """A forward did not finish within the step timeout: it is stuck (a hung collective, a
    dead or hung peer rank). Its thread cannot be reclaimed, so the engine cannot go on."""


class Engine:
    """One rank's serving loop, as `scheduler` (default: `SchedulerConfig()`) and the step
    token budget (default: `EngineConfig`'s) say; `build_engine(config)` builds it from the
    config tree, so no default lives here. `lockstep`: this rank steps with its DP peers."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: SchedulerConfig | None = None,
        *,
        max_num_batched_tokens: int | None = None,
        lockstep: bool = False,
    ):
        settings = SchedulerConfig() if scheduler is None else scheduler
        if max_num_batched_tokens is None:
            max_num_batched_tokens = EngineConfig.max_num_batched_tokens
        self.runner = runner
        info = runner.info
        max_model_len = settings.context_length(info.max_model_len)
        if runner.compiles_on_first_use:
            runner.warm_up(settings.max_num_seqs)  # every rank builds its engine at the same point
        self.future_map = FutureMap(settings.max_num_seqs, device=runner.device)
        runner.future_map = self.future_map
        self.scheduler = _scheduler(runner, settings, self.future_map, max_num_batched_tokens, max_model_len)
        #: Every live request's sampling state (None on a pipeline's first stage: the last samples).
        self.sampling: SamplingStates | None = SamplingStates(
            info.eos_token_ids, GrammarCompiler(info.tokenizer, sorted(info.eos_token_ids), cache_mb=settings.grammar_cache_mb))
        self.outputs = OutputProcessor(lambda ids: info.tokenizer.decode(ids, skip_special_tokens=True))
        self.overlap_schedule = settings.overlaps_schedule(runner.device.type, torch.get_num_threads(), available_cores())
        self.lockstep = lockstep
        self.step_timeout_s = settings.step_timeout_s
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tandem-forward") if self.overlap_schedule else None
        self._pending: tuple[SchedulerStep, Future] | None = None
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.forward_busy_s = 0.0
        #: Steps whose forward raised (their requests were failed; the engine went on).
        self.failed_steps = 0
        self.last_failure: str | None = None
        #: Set when a failed step left state that later steps cannot trust (DeepEP's
        #: low-latency buffers): every request is refused with this message from then on.
        self.stopped: str | None = None
        #: The last applied step found every DP rank idle (its agreed padded size was 0): in
        #: lockstep, the one signal all ranks see alike that the work is done everywhere.
        self.idle_everywhere = False

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestOutput | None:
        """Queue a request; a request that can never run comes back at once as an error output."""
        if self.stopped is not None:
            return RequestOutput.failed(request_id, self.stopped)
        try:
            if self.sampling is not None:  # refuses an id in use, as the scheduler does
                self.sampling.add(request_id, params, prompt_ids)
            try:
                self.scheduler.add_request(Request(request_id, list(prompt_ids), params))
            except BaseException:
                self._forget(request_id)
                raise
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the rank down
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            return RequestOutput.failed(request_id, message)
        self.outputs.add_request(request_id)
        self.prompt_tokens += len(prompt_ids)
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now; its last output, or None if it is unknown or done."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._forget(request_id)
        return self.outputs.finish(request, "abort")

    def _forget(self, request_id: str) -> None:
        """A request ended (however it ended): its sampling state goes."""
        if self.sampling is not None:
            self.sampling.drop(request_id)

    @property
    def has_work(self) -> bool:
        """Requests to run, or a step in flight whose tokens are still to be applied. (A
        dummy step in flight is not work: in lockstep, every rank runs one more step only
        when some rank has work.)"""
        return self.scheduler.has_unfinished or (self._pending is not None and bool(self._pending[0].scheduled))

    # -- steps ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration of the loop; returns the output deltas it produced."""
        if self.stopped is not None:
            if self._pending is not None:  # a step already in flight: its results are not trusted either
                _, future = self._pending
                self._pending = None
                try:
                    self._result(future)
                except Exception:  # noqa: BLE001 - its requests are failed below regardless
                    pass
            return self._refuse_all()
        return self._step_overlap() if self.overlap_schedule else self._step_normal()

    def _step_normal(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if not step.scheduled and not self.lockstep:
            return []
        return self._apply(step, self._forward(step, self.sampling.samplers_of(step.request_ids)))

    def _step_overlap(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        running = None
        if step.scheduled or self.lockstep:
            # Samplers looked up here: applying the previous step below may end one this step runs.
            running = (step, self._worker.submit(self._forward, step, self.sampling.samplers_of(step.request_ids)))
        outputs = []
        if self._pending is not None:
            previous, future = self._pending
            outputs = self._apply(previous, self._result(future))
        self._pending = running
        return outputs

    def idle(self) -> None:
        """Called by the rank loop while no rank has work (a pipeline keeps its links alive)."""

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight (overlap loop) and apply it."""
        if self._pending is None:
            return []
        previous, future = self._pending
        self._pending = None
        return self._apply(previous, self._result(future))

    def _forward(self, step: SchedulerStep, samplers: list) -> StepResult | BaseException:
        start = time.perf_counter()
        try:
            result = self.runner.execute(
                [entry.chunk for entry in step.scheduled],
                [entry.request.params for entry in step.scheduled],
                samplers,
                finishes_prompt=[entry.slot is not None for entry in step.scheduled],
                future_slots=[entry.slot for entry in step.scheduled],
            )
            # Here, on the forward thread, so the next step's grammar masks (planned before
            # these tokens were applied) already see them.
            advance_constraints(SamplingStates.constraints(samplers), result.tokens)
            return result
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            return exc
        finally:
            self.forward_busy_s += time.perf_counter() - start

    def _result(self, future: Future) -> StepResult | BaseException:
        try:
            return future.result(timeout=self.step_timeout_s)
        except TimeoutError:
            raise StepTimeoutError(
                f"a model step did not finish within {self.step_timeout_s:g} s (a hung collective, "
                "or a dead or hung peer rank)"
            ) from None

    def _apply(self, step: SchedulerStep, result: StepResult | BaseException) -> list[RequestOutput]:
        self.idle_everywhere = not isinstance(result, BaseException) and result.num_tokens_padded == 0
        if isinstance(result, BaseException):
            return self._fail(step, result)
        outputs = [
            self._fail_request(entry.request, f"structured output failed: {refusal}")
            for entry in step.scheduled
            if not entry.request.finished and self.sampling is not None
            and (refusal := self.sampling.refusal(entry.request.request_id))
        ]
        for update in self.scheduler.apply(step, result.tokens, result.logprobs, result.prompt_logprobs):
            output = self.outputs.process(update)
            if output is None:
                continue
            if output.finished:
                self.scheduler.finish(update.request, output.finish_reason)
                self._forget(update.request.request_id)
            outputs.append(output)
        self.generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _fail(self, step: SchedulerStep, error: BaseException) -> list[RequestOutput]:
        self.failed_steps += 1
        message = f"model step failed: {type(error).__name__}: {error}"
        self.last_failure = message
        if self.stopped is None:
            self.stopped = _why_a_failed_step_stops(self.runner, error)
        outputs = []
        for entry in step.scheduled:
            request = entry.request
            if entry.slot is not None:
                request.in_flight -= 1
            if not request.finished:
                outputs.append(self._fail_request(request, message))
        return outputs

    def _refuse_all(self) -> list[RequestOutput]:
        """A stopped engine fails every request it still holds, once."""
        held = list(self.scheduler.waiting) + list(self.scheduler.running)
        return [self._fail_request(request, self.stopped) for request in held if not request.finished]

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish(request, "error")
        self._forget(request.request_id)
        self.outputs.discard(request.request_id)
        return RequestOutput.failed(
            request.request_id, message,
            num_prompt_tokens=len(request.prompt_ids), num_output_tokens=len(request.output_ids),
        )

    # -- the face every engine kind shows its callers (rank loop, `generate`) ----------------

    #: Whether requests are added here: every one-stage rank and a pipeline's first stage. A
    #: later pipeline stage (`LaterStage`) only runs what the stage before sends.
    takes_requests = True

    def control_plane(self, world_size: int):
        """`(group, size)`: the ranks whose loops agree on each step (the scheduler thread's
        own gloo group, not the runner's, which the forward worker uses meanwhile)."""
        import torch.distributed as dist

        return (dist.new_group(backend="gloo") if world_size > 1 else None), world_size

    def trace_group(self, control):
        """The group whose ranks' timelines go into one `--trace` file."""
        return control

    def startup_note(self, max_num_seqs: int) -> str | None:
        """A start-up line about this engine's choices, if it has one to say."""
        return None

    def my_prompts(self, prompts: list, rank: int, world_size: int) -> list:
        """This rank's share of `generate`'s prompts: prompt i on rank i % world_size."""
        return [(i, prompt) for i, prompt in enumerate(prompts) if i % world_size == rank]

    def keeps_going(self) -> bool:
        """Whether offline generation steps again: while this rank has work, or, in lockstep
        with other DP ranks, until a step finds every rank idle (the signal every rank sees
        alike, so all leave the loop after the same step); a pipeline asks its first stage."""
        return not self.idle_everywhere if self.lockstep else self.has_work

    def stats(self) -> RankCounters:
        return RankCounters.of(self)

    def close(self) -> None:
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if getattr(self.runner, "threads", None) is not None:  # the process's thread count back
            self.runner.threads.restore()


def _why_a_failed_step_stops(runner, error: BaseException) -> str | None:
    """Why the engine cannot run on after `error` failed a step, or None when it can."""
    from tandem.modular_kernels.capturable import state_lost_by_a_failed_step

    lost = state_lost_by_a_failed_step(getattr(runner, "model", None) or [])
    if not lost:
        return None
    return (f"engine stopped: a model step failed ({type(error).__name__}: {error}) and the {', '.join(lost)} "
            "all2all backend cannot run on after a failed step (its buffers are out of step with the peer ranks and "
            "the captured graphs); restart the server")


def _scheduler(runner: ModelRunner, settings: SchedulerConfig, future_map: FutureMap, max_num_batched_tokens: int,
               max_model_len: int) -> Scheduler:
    return Scheduler(
        runner.allocator,
        runner.block_size,
        future_map,
        settings,
        max_num_batched_tokens=max_num_batched_tokens,
        # The ranks enforce --max-model-len too, not only the front end that admits requests.
        max_model_len=max_model_len,
        eos_token_ids=runner.info.eos_token_ids,
        vocab_size=_vocab_size(runner.model),
    )


def _vocab_size(model) -> int | None:
    config = getattr(model, "config", None)
    return None if config is None else config_value(config, "vocab_size", default=None)


def run_to_completion(
    engine: Engine,
    prompts: Sequence[tuple[int, list[int], SamplingParams]],
    *,
    keep_going: Callable[[Engine], bool] | None = None,
) -> list[Completion]:
    """Offline generation through the serving loop: add `prompts` (`(index, prompt token
    ids, params)`) to `engine`, step it until they finish, and return their completions in
    input order. `keep_going(engine)` says whether to step again; by default the engine's
    own `keeps_going`."""
    if keep_going is None:
        keep_going = type(engine).keeps_going
    completions: dict[str, Completion] = {}
    for index, ids, params in prompts:
        request_id = str(index)
        rejected = engine.add_request(request_id, list(ids), params)
        if rejected is not None:
            raise ValueError(f"prompt {index}: {rejected.error}")
        completions[request_id] = Completion(index, "", [], "")
    try:
        while keep_going(engine):
            _collect(completions, engine.step())
        _collect(completions, engine.drain())
    finally:
        engine.close()
    unfinished = [c.index for c in completions.values() if not c.finish_reason]
    if unfinished:
        raise RuntimeError(f"prompts {unfinished} were left unfinished when every rank stopped stepping")
    return sorted(completions.values(), key=lambda c: c.index)


def _collect(completions: dict[str, Completion], outputs: list[RequestOutput]) -> None:
    for output in outputs:
        completion = completions[output.request_id]
        completion.text += output.new_text
        completion.token_ids += output.new_token_ids
        if output.finished:
            if output.finish_reason == "error":
                raise RuntimeError(f"prompt {completion.index}: {output.error}")
            completion.finish_reason = output.finish_reason


__all__ = ["Engine", "RankCounters", "StepTimeoutError", "run_to_completion"]
