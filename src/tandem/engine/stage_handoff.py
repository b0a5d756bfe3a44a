"""What travels between pipeline stages with a micro-batch, and how little of it must.

The first stage plans a micro-batch and builds its step inputs once; every later stage runs
its layers on exactly those inputs. So a micro-batch carries its *built* inputs (positions,
slot mapping, block table, ... as tensors in the link's one message) instead of the scheduled
chunks (token and block ids) that each later stage used to turn into the same tensors again,
and a request's sampling parameters ride only with the first micro-batch that carries the
request: the last stage keeps them, with the request's generator, until the first stage
reports the request finished. Why: on tiny-moe the second stage spent more time rebuilding
64 requests' inputs and unpickling their parameters than running its layer (profile in
docs/pipeline.md).

Plans flow through the stages in order, so "finished" (drop) always reaches the last stage
after every micro-batch that still carried the request, and a request id used again later is
announced again after its drop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tandem.models.paged_attention import AttentionMetadata
from tandem.worker.sampling import SamplingParams
from tandem.worker.sampling_states import SamplingStates
from tandem.worker.step_inputs import StepInputs
from tandem.worker.step_plan import StepPlan

STEP, HEARTBEAT, STOP = "step", "heartbeat", "stop"
#: Keys of the built inputs' tensors in a micro-batch's tensor dict.
_INPUTS = "inputs."
_POSITIONS = _INPUTS + "positions"
_ATTENTION = _INPUTS + "attn."


@dataclass
class StageCounters:
    """Where one stage's time went while the pipeline had work: `busy_s` running its layers
    (and sampling), `idle_s` waiting for its next micro-batch (for the first stage: for the
    results of its oldest one). Waits that follow an idle pipeline are not bubbles."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    micro_batches: int = 0

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


@dataclass
class MicroBatchPlan:
    """What every stage needs to run one micro-batch, beside the tensors (hidden states and
    built inputs) of its message."""

    kind: str = STEP
    request_ids: list[str] = field(default_factory=list)
    #: Sampling parameters of the requests the later stages have not seen yet.
    new_sampling: dict[str, SamplingParams] = field(default_factory=dict)
    #: The prompts of those whose sampling reads them (`SamplingParams.penalizes_prompt`).
    new_prompts: dict[str, list[int]] = field(default_factory=dict)
    samples: list[bool] = field(default_factory=list)
    #: The step as the first stage's DP ranks planned it (padding, ubatch cut, TBO strategy,
    #: SBO): every later stage runs it the same way rather than deciding again.
    step: StepPlan = field(default_factory=lambda: StepPlan(num_tokens=0, num_tokens_padded=0))
    #: The built inputs' values that are not tensors (token counts, attention scalars).
    num_scheduled_tokens: list[int] = field(default_factory=list)
    attention: dict = field(default_factory=dict)
    #: Requests finished since the previous micro-batch (the last stage drops their state).
    finished_ids: list[str] = field(default_factory=list)
    #: A start-up measurement (`choose_micro_batches`), not serving work: no stage counts it
    #: among its runner's steps (fault injection and the step counters see serving steps only).
    probe: bool = False
    error: str | None = None
    #: stage -> a copy of its counters, filled in on the way (the first stage reads them at the end).
    stage_stats: dict[int, StageCounters] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class MicroBatchResult:
    """What the last stage sends back to the first beside the sampled ids: the first stage
    kept the plan, so only the outcome and the stages' counters travel back."""

    error: str | None
    stage_stats: dict[int, StageCounters]


def pack_inputs(plan: MicroBatchPlan, inputs: StepInputs | None) -> dict[str, torch.Tensor]:
    """The built inputs as tensors for the micro-batch's message; their other values go
    into `plan`. The token ids stay behind: later stages start from hidden states."""
    if inputs is None:
        return {}
    plan.num_scheduled_tokens = list(inputs.num_scheduled_tokens)
    tensors = {_POSITIONS: inputs.positions}
    for item in dataclasses.fields(AttentionMetadata):
        value = getattr(inputs.attn_metadata, item.name)
        if isinstance(value, torch.Tensor):
            tensors[_ATTENTION + item.name] = value
        else:
            plan.attention[item.name] = value
    return tensors


def unpack_inputs(plan: MicroBatchPlan, message: dict) -> StepInputs:
    """The step inputs the first stage built, from a micro-batch's message."""
    attention = dict(plan.attention)
    for item in dataclasses.fields(AttentionMetadata):
        if _ATTENTION + item.name in message:
            attention[item.name] = message[_ATTENTION + item.name]
    positions = message[_POSITIONS]
    return StepInputs(
        input_ids=positions.new_empty(0), positions=positions, attn_metadata=AttentionMetadata(**attention),
        num_scheduled_tokens=list(plan.num_scheduled_tokens),
    )


def input_tensors(message: dict) -> dict[str, torch.Tensor]:
    """The built inputs' tensors of a micro-batch's message (a middle stage passes them on)."""
    return {key: value for key, value in message.items() if key.startswith(_INPUTS)}


class SamplingAnnouncer:
    """The first stage's record of which requests' parameters the last stage holds."""

    def __init__(self) -> None:
        self._announced: set[str] = set()

    def new(self, request_ids: list[str], params: list[SamplingParams]) -> dict[str, SamplingParams]:
        fresh = {r: p for r, p in zip(request_ids, params) if r not in self._announced}
        self._announced.update(fresh)
        return fresh

    def forget(self, request_ids: list[str]) -> None:
        self._announced.difference_update(request_ids)

    def __len__(self) -> int:
        return len(self._announced)


def prompts_to_announce(new_sampling: dict[str, SamplingParams], request_ids: list[str], prompts: list[list[int]]) -> dict:
    """The prompts the last stage needs with the requests just announced: those whose
    sampling reads the prompt, the others stay on the first stage."""
    return {r: p for r, p in zip(request_ids, prompts) if r in new_sampling and new_sampling[r].penalizes_prompt}


def learn_sampling(states: SamplingStates, plan: MicroBatchPlan) -> None:
    """The last stage's sampling states follow the first stage's: drop the finished requests,
    then add the new ones (in this order: an id used again is announced again after its drop)."""
    for request_id in plan.finished_ids:
        states.drop(request_id)
    for request_id, params in plan.new_sampling.items():
        states.add(request_id, params, plan.new_prompts.get(request_id, ()))


__all__ = [
    "HEARTBEAT", "STEP", "STOP", "MicroBatchPlan", "MicroBatchResult", "SamplingAnnouncer", "learn_sampling", "prompts_to_announce",
    "input_tensors", "pack_inputs", "unpack_inputs",
]
