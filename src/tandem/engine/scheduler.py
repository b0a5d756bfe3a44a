"""Continuous batching: which requests run in the next step, with how many tokens.

Per step the scheduler fills a token budget (`max_num_batched_tokens`): first the running
requests in admission order (one decode token each, or the next chunk of a prompt being
prefilled in pieces), then waiting requests first come first served while fewer than
`max_num_seqs` run. Every chunk gets the KV blocks it needs; when the cache is full, the
most recently admitted running request is preempted (its blocks freed, to be recomputed
from its prompt and output so far when it is readmitted).

The overlapped loop plans step N+1 before step N's tokens are known: a request that
samples in step N has one token *in flight*, and its next chunk is that token's
`FutureMap` placeholder. Results are applied in step order; a request that finished or was
aborted meanwhile just drops its late token. A chunk handed to the forward carries copies
of the request's lists, so nothing the running forward reads is modified in place.

The scheduler only schedules: a request's sampling state (random stream, penalties, grammar)
lives with the engine's `SamplingStates` (`worker/sampling_states.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from tandem.config import EngineConfig, SchedulerConfig
from tandem.worker.step_inputs import ScheduledChunk
from tandem.worker.future_map import FutureMap, placeholder
from tandem.worker.kv_cache import BlockAllocator, blocks_needed
from tandem.worker.sampling import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    #: Tokens whose K/V are in the cache or being written by a scheduled step.
    num_computed: int = 0
    #: Tokens sampled by steps whose results have not been applied yet; the newest one's
    #: FutureMap slot is `pending_slot`.
    in_flight: int = 0
    pending_slot: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    #: With `params.prompt_logprobs`: this many prompt positions have been scheduled to give
    #: their log-probabilities (a preempted request does not ask again).
    prompt_logprobs_planned: int = 0
    #: When (this rank's `time.monotonic()`) it entered the queue and was first scheduled (a
    #: preempted request keeps its first): events of vLLM's interval metrics.
    queued_at: float = 0.0
    scheduled_at: float | None = None

    @property
    def known_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class TokenUpdate:
    """What one applied step brought one request: its sampled token (None: a prompt chunk
    that samples nothing), that token's log-probabilities, the prompt log-probabilities the
    chunk gave, and a token-level `finish_reason` ("stop" for an end or stop token, which
    the scheduler already dropped from the output, "length"), if any."""

    request: Request
    token: int | None = None
    sampled_at: float | None = None
    logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None


@dataclass
class ScheduledRequest:
    request: Request
    chunk: ScheduledChunk
    #: FutureMap slot of the token this chunk samples, or None (a prompt chunk that does
    #: not reach the end of the known tokens samples nothing).
    slot: int | None


@dataclass
class SchedulerStep:
    scheduled: list[ScheduledRequest]
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.chunk.token_ids) for s in self.scheduled)

    @property
    def request_ids(self) -> list[str]:
        return [s.request.request_id for s in self.scheduled]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        future_map: FutureMap,
        config: SchedulerConfig | None = None,
        *,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_model_len: int = 4096,
        eos_token_ids: set[int] | None = None,
        vocab_size: int | None = None,
    ):
        """`config`: the scheduler's section of the config tree (`--max-num-seqs`); the rest is
        what the engine knows of its model and cache."""
        max_num_seqs = (config or SchedulerConfig()).max_num_seqs
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.allocator = allocator
        self.block_size = block_size
        self.future_map = future_map
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        #: Token ids a prompt may hold are [0, vocab_size): one outside would fail the whole step.
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids or set()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        #: Largest prompt chunk for a request with this many tokens already computed
        #: (dynamic chunking); None: only the step's token budget limits it.
        self.chunk_limit: Callable[[int], int] | None = None

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        bad = [t for t in request.prompt_ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: prompt token id {bad[0]} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        total = len(request.prompt_ids) + request.params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: {len(request.prompt_ids)} prompt tokens + max_tokens "
                f"{request.params.max_tokens} exceed the context length {self.max_model_len}"
            )
        if blocks_needed(total, self.block_size) > self.allocator.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {total} tokens of KV cache, more than the whole cache "
                f"({self.allocator.num_blocks * self.block_size} tokens)"
            )
        request.queued_at = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request now (its blocks freed at once); None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        self.finish(request, "abort")
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_usage(self) -> float:
        return self.allocator.usage

    # -- scheduling -----------------------------------------------------------------------

    def schedule(self, *, max_requests: int | None = None, skip_in_flight: bool = False) -> SchedulerStep:
        """Plan one step. The pipeline loop keeps several steps (micro-batches) in flight: it
        caps the requests per step (`max_requests`) so they spread over the micro-batches,
        and skips requests whose sampled token is still in flight (`skip_in_flight`); a
        prompt whose earlier chunk is in flight samples nothing, so its next chunk can follow
        at once in the next micro-batch (chunked pipeline prefill)."""
        budget = self.max_num_batched_tokens
        step = SchedulerStep([])
        scheduled_ids: set[str] = set()
        room = lambda: max_requests is None or len(step.scheduled) < max_requests  # noqa: E731
        index = 0
        while index < len(self.running) and budget > 0 and room():
            request = self.running[index]
            if skip_in_flight and request.in_flight:
                index += 1
                continue
            entry = self._plan(request, budget, step, scheduled_ids)
            if entry is None:
                if request.status is RequestStatus.RUNNING:
                    index += 1  # nothing to run this step (e.g. a preempted victim's slot)
                continue  # it preempted itself: the list shrank under `index`
            step.scheduled.append(entry)
            scheduled_ids.add(request.request_id)
            budget -= len(entry.chunk.token_ids)
            index += 1
        waiting_index = 0
        while waiting_index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and room():
            request = self.waiting[waiting_index]
            if request.in_flight:
                waiting_index += 1  # preempted with a token still in flight: wait for it
                continue
            entry = self._plan(request, budget, step, scheduled_ids, admitting=True)
            if entry is None:
                break  # no room in the cache: first come, first served
            self.waiting.pop(waiting_index)
            if request.scheduled_at is None:
                request.scheduled_at = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.scheduled.append(entry)
            scheduled_ids.add(request.request_id)
            budget -= len(entry.chunk.token_ids)
        slots = self.future_map.reserve(sum(1 for e in step.scheduled if e.slot is not None))
        for entry, slot in zip((e for e in step.scheduled if e.slot is not None), slots):
            entry.slot = slot
            entry.request.in_flight += 1
            entry.request.pending_slot = slot
        return step

    def _plan(self, request: Request, budget: int, step: SchedulerStep, scheduled: set[str], admitting: bool = False):
        known = request.known_ids
        if request.in_flight:
            # Decode on the token the running step is sampling.
            token_ids = [placeholder(request.pending_slot)]
            start = request.num_computed
            samples = True
        else:
            remaining = len(known) - request.num_computed
            if remaining <= 0:
                return None
            n = min(remaining, budget)
            if self.chunk_limit is not None:
                n = min(n, max(1, int(self.chunk_limit(request.num_computed))))
            token_ids = known[request.num_computed : request.num_computed + n]
            start = request.num_computed
            samples = start + n == len(known)
        need = blocks_needed(start + len(token_ids), self.block_size) - len(request.blocks)
        while need > 0 and self.allocator.num_free < need:
            if admitting:
                return None
            victim = self._pick_victim(request, scheduled)
            self._preempt(victim, step)
            if victim is request:
                return None
        if need > 0:
            request.blocks += self.allocator.allocate(need)
        chunk = ScheduledChunk(list(token_ids), start, list(request.blocks))
        if request.params.prompt_logprobs is not None and not request.in_flight:
            plan_prompt_logprobs(request, chunk)
        # Counted as computed once scheduled: the next plan starts after this chunk, even
        # when (overlapped loop) this step has not run yet.
        request.num_computed = start + len(token_ids)
        return ScheduledRequest(request, chunk, -1 if samples else None)

    def _pick_victim(self, request: Request, scheduled: set[str]) -> Request:
        for candidate in reversed(self.running):
            if candidate.request_id not in scheduled and candidate is not request:
                return candidate
        return request

    def _preempt(self, request: Request, step: SchedulerStep) -> None:
        self.allocator.free(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(request)
        self.waiting.insert(0, request)
        step.preempted.append(request.request_id)

    # -- results --------------------------------------------------------------------------

    def apply(self, step: SchedulerStep, tokens: list[int | None], logprobs: list | None = None,
              prompt_logprobs: list | None = None) -> list[TokenUpdate]:
        """Apply a finished step's sampled tokens (in step order) and the token-level stops;
        return each live request's news for the output processor (log-probabilities where
        requests asked for them). The step's tokens are timed together, now that their
        values are on the host. The caller finishes the requests whose output ends."""
        now = time.monotonic()
        updates = []
        for k, (entry, token) in enumerate(zip(step.scheduled, tokens)):
            request = entry.request
            if entry.slot is not None:
                request.in_flight -= 1
            if request.finished:
                continue  # finished or aborted while this step ran: drop its late token
            update = TokenUpdate(request, prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs[k])
            if entry.slot is not None and token is not None:
                request.output_ids.append(int(token))
                update.token, update.sampled_at = int(token), now
                update.logprobs = None if logprobs is None else logprobs[k]
                update.finish_reason = self._token_stop(request, int(token))
            if update.token is not None or update.prompt_logprobs is not None:
                updates.append(update)
        return updates

    def _token_stop(self, request: Request, token: int) -> str | None:
        """"stop" for an end or stop token (dropped: it is not part of the completion),
        "length" at max_tokens or the context length; stop strings are the output's."""
        params = request.params
        # A constrained request's grammar allows its end token only once the document is whole.
        ends = not params.ignore_eos or params.json_schema is not None
        if (token in self.eos_token_ids and ends) or token in params.stop_token_ids:
            request.output_ids.pop()
            return "stop"
        if (
            len(request.output_ids) >= params.max_tokens
            or len(request.prompt_ids) + len(request.output_ids) >= self.max_model_len
        ):
            return "length"
        return None

    def finish(self, request: Request, reason: str) -> None:
        """End a request (`reason` as `RequestOutput.finish_reason`): its blocks are freed and
        a token of it still in flight will be dropped."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.allocator.free(request.blocks)
        request.blocks = []
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)


def plan_prompt_logprobs(request: Request, chunk: ScheduledChunk) -> None:
    """Ask `chunk` for the prompt log-probabilities its rows give that no earlier chunk of
    `request` was asked for: row p predicts prompt token p + 1."""
    first = max(chunk.num_computed, request.prompt_logprobs_planned)
    last = min(chunk.num_computed + len(chunk.token_ids), len(request.prompt_ids) - 1)
    if last > first:
        chunk.prompt_targets = request.prompt_ids[first + 1 : last + 1]
        chunk.prompt_targets_row = first - chunk.num_computed
        request.prompt_logprobs_planned = last


__all__ = ["Request", "RequestStatus", "ScheduledRequest", "Scheduler", "SchedulerStep", "TokenUpdate"]
