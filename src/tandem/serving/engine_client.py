"""`EngineClient`: what the HTTP app (or any front end) needs from the engine.

An implementation owns the engine rank processes; `generate` is an async iterator of
`RequestOutput` deltas for one request, and leaving the iteration early (client gone, task
cancelled) aborts the request, freeing its KV blocks at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tandem.contexts import StepTimes
from tandem.engine.counters import RankCounters
from tandem.ubatch.planner import PlannerStats
from tandem.worker.sampling import SamplingParams
from tandem.engine.outputs import RequestOutput


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests (a rank died, or it is shutting down); HTTP 503."""


class EngineOverloadedError(RuntimeError):
    """The request queue is full; HTTP 429."""


@dataclass
class EngineStats:
    """A snapshot for `/metrics` and `/health`."""

    num_ranks: int = 1
    waiting: int = 0  # requests queued, not yet running (all ranks)
    running: int = 0  # requests with a running sequence (all ranks)
    kv_usage: float = 0.0  # fraction of KV blocks in use, max over ranks
    steps: int = 0  # model steps run (summed over ranks)
    ubatched_steps: int = 0  # of which split into ubatches
    ubatch_yields: int = 0  # ubatch switches made
    step_time_s: float = 0.0  # total wall time inside model steps (summed over ranks)
    forward_busy_s: float = 0.0  # time the forward worker spent running steps (summed over ranks)
    failed_steps: int = 0  # steps whose forward raised; their requests failed, serving went on
    times: StepTimes = field(default_factory=StepTimes)  # the time model of every step (summed over ranks)
    generated_tokens: int = 0
    prompt_tokens: int = 0
    #: Pipeline parallelism: each stage's idle (bubble) fraction, mean over the DP ranks.
    pipeline_stage_idle_fraction: list[float] = field(default_factory=list)
    #: The overlap planners' counters, summed over the ranks that run one.
    planner: PlannerStats | None = None
    #: Each engine's (data-parallel rank's) own counters.
    per_rank: list[RankCounters] = field(default_factory=list)


class EngineClient(ABC):
    model_name: str
    max_model_len: int
    tokenizer: Any  # a `tokenizers.Tokenizer`
    eos_token_ids: set[int]
    #: The chat template from the model directory's tokenizer_config.json, if any.
    chat_template: str | None = None
    #: Engines (data-parallel ranks) taking requests: `RequestOutput.engine_index` names one,
    #: and `EngineStats.per_rank[i]` holds engine i's counters.
    num_engines: int = 1

    @abstractmethod
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Raises `EngineUnavailableError` / `EngineOverloadedError` before yielding when the
        request cannot be taken; a request that fails later ends with an output whose
        `finish_reason` is "error"."""

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def health(self) -> tuple[bool, str]:
        """(True, "ok") when every rank is alive and stepping; else (False, reason)."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    async def shutdown(self) -> None: ...
