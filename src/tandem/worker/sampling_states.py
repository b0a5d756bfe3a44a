"""The one home of per-request sampling state on a rank that samples: every live request's
`SamplingParams` and `RequestSampler` (its seeded random stream, penalty counts, grammar
matcher), keyed by request id. It is fed the way vLLM's worker-side input batch is, from the
loop that schedules: `add` for a new request, `drop` when the request ends however it ends
(finished, aborted, failed), and kept across preemption. The engine in one process and the
last pipeline stage (told of new and finished requests by the first stage) hold the same
class; the scheduler keeps none of it."""

from __future__ import annotations

from typing import Sequence

from tandem.worker.grammar import GrammarCompiler, GrammarConstraint
from tandem.worker.sampling import RequestSampler, SamplingParams


class SamplingStates:
    def __init__(self, eos_token_ids: Sequence[int] = (), grammars: GrammarCompiler | None = None):
        self.eos_token_ids = sorted(eos_token_ids)
        self.grammars = grammars
        self.params: dict[str, SamplingParams] = {}
        self.samplers: dict[str, RequestSampler] = {}

    def add(self, request_id: str, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        """Make a new request's sampling state (its grammar compiled, or taken from the cache);
        `ValueError` for an id in use or a schema that cannot be enforced."""
        if request_id in self.params:
            raise ValueError(f"request id {request_id!r} is already in use")
        sampler = params.make_sampler(prompt_ids, self.eos_token_ids)
        if params.json_schema is not None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer to compile a JSON schema constraint with")
            sampler.constraint = self.grammars.constraint(params.json_schema)
        self.params[request_id], self.samplers[request_id] = params, sampler

    def drop(self, request_id: str) -> None:
        """Forget an ended request (nothing if it is unknown)."""
        self.params.pop(request_id, None)
        self.samplers.pop(request_id, None)

    def for_requests(self, request_ids: Sequence[str]) -> tuple[list[SamplingParams], list[RequestSampler]]:
        """The parameters and samplers of a step's requests, in its order."""
        try:
            return [self.params[r] for r in request_ids], [self.samplers[r] for r in request_ids]
        except KeyError as exc:
            raise RuntimeError(f"no sampling state for request {exc}: it was never added, or dropped while "
                               "still scheduled") from None

    def samplers_of(self, request_ids: Sequence[str]) -> list[RequestSampler]:
        return self.for_requests(request_ids)[1]

    def refusal(self, request_id: str) -> str | None:
        """Why the request's grammar refused a token it allowed (it must fail), or None."""
        sampler = self.samplers.get(request_id)
        return None if sampler is None or sampler.constraint is None else sampler.constraint.refusal

    @staticmethod
    def constraints(samplers: Sequence[RequestSampler]) -> list[GrammarConstraint | None]:
        return [sampler.constraint for sampler in samplers]

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.params


__all__ = ["SamplingStates"]
