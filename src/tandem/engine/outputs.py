"""What the engine reports about a request: after each step as the front end receives it
(`RequestOutput`), and at its end as offline generation returns it (`Completion`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One increment of a request's output. Deltas only: `new_token_ids` and `new_text` are
    what was produced since the previous output of the same request. `finished` is set on
    the last one, with `finish_reason` "stop" (eos, stop token or stop string), "length"
    (max_tokens or the context length), "abort" (cancelled) or "error" (`error` says why)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    #: With `SamplingParams.logprobs`: per new token, [(id, logprob)] of it, then of its most
    #: likely alternatives (raw model log-probabilities).
    new_logprobs: list[list[tuple[int, float]]] | None = None
    #: With `SamplingParams.prompt_logprobs`, on the request's first output only: per prompt
    #: token after the first, [(id, logprob)] of it given the tokens before it, then of the
    #: most likely tokens at its place (raw model log-probabilities).
    prompt_logprobs: list[list[tuple[int, float]]] | None = None
    #: The request's events on the clock (`time.monotonic()`) of the rank that runs it: queued,
    #: first scheduled, and each token sampled since the previous output (a stop token that is
    #: not part of the completion included). Only differences between them mean something: the
    #: front end derives vLLM's queue/prefill/decode intervals from them, never mixing clocks.
    queued_at: float | None = None
    scheduled_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    #: The data-parallel rank (vLLM's "engine") that ran it, as the engine client routed it.
    engine_index: int = 0

    @classmethod
    def failed(cls, request_id: str, error: str, *, num_prompt_tokens: int = 0, num_output_tokens: int = 0) -> "RequestOutput":
        """The last output of a request that ends in an error (refused, or its step failed)."""
        return cls(
            request_id, [], "", finished=True, finish_reason="error", error=error,
            num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
        )


@dataclass
class Completion:
    """A finished prompt of offline generation (`tandem generate`), `index` its place in the input."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"
