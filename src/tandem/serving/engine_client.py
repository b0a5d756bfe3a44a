"""`EngineClient`: what the HTTP app (or any front end) needs from the engine.

An implementation owns the engine rank processes; `generate` is an async iterator of
`RequestOutput` deltas for one request, and leaving the iteration early (client gone, task
cancelled) aborts the request, freeing its KV blocks at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tandem.engine.counters import RankCounters
from tandem.worker.sampling import SamplingParams
from tandem.engine.outputs import RequestOutput


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests (a rank died, or it is shutting down); HTTP 503."""


class EngineOverloadedError(RuntimeError):
    """The request queue is full; HTTP 429."""


@dataclass
class EngineStats:
    """A snapshot for `/metrics`: each engine's (data-parallel rank's) counters as it sent
    them, and all of them as one."""

    num_ranks: int = 1
    #: `RankCounters.merge` of `per_rank`: sums over the ranks, the fullest rank's KV usage,
    #: each pipeline stage's mean idle fraction.
    total: RankCounters = field(default_factory=RankCounters)
    per_rank: list[RankCounters] = field(default_factory=list)

    @classmethod
    def of(cls, num_ranks: int, per_rank: list[RankCounters]) -> "EngineStats":
        return cls(num_ranks, RankCounters.merge(per_rank), list(per_rank))


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
