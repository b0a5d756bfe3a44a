"""The messages between the front end and the head rank (rank 0), through two queues.

Front end -> head: `AddRequest`, `AbortRequest`, `Shutdown`; the head broadcasts them to every
rank of its control group, and each rank applies those addressed to it (`rank`).
Head -> front end: `Progress` lines while starting, `Ready` once warm, then `Outputs` (output
deltas of a step) and `Stats` (per-rank counters, also the head's heartbeat), and `Fatal`
before a rank exits on an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.worker.sampling import SamplingParams
from tandem.engine.outputs import RequestOutput


@dataclass(frozen=True)
class AddRequest:
    rank: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    rank: int
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Progress:
    text: str


@dataclass(frozen=True)
class Ready:
    model_name: str
    max_model_len: int
    world_size: int


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput] = field(default_factory=list)


@dataclass(frozen=True)
class Stats:
    #: Each rank's `tandem.engine.counters.RankCounters` (None: not reported this time).
    per_rank: list = field(default_factory=list)


@dataclass(frozen=True)
class Fatal:
    message: str


#: What the front end sends to the head, and what the head sends back.
ToHead = AddRequest | AbortRequest | Shutdown
FromHead = Progress | Ready | Outputs | Stats | Fatal

__all__ = [
    "AbortRequest", "AddRequest", "Fatal", "FromHead", "Outputs", "Progress", "Ready", "Shutdown", "Stats", "ToHead",
]
