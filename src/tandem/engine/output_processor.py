"""From sampled tokens to what the front end receives: detokenizing, stop strings,
log-probabilities and output deltas.

The scheduler applies a step's tokens to its requests (the token-level stops: end tokens,
stop token ids, max_tokens, the context length) and hands each request's news here as a
`TokenUpdate`; this module keeps what only the output needs (the text so far, what was
already sent, the log-probabilities) in one `OutputState` per request, finds stop strings,
and builds the `RequestOutput` delta. The engine finishes a request in the scheduler when
its delta is the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tandem.engine.outputs import RequestOutput
from tandem.engine.scheduler import Request, TokenUpdate


@dataclass
class OutputState:
    """One request's output so far: its text, what of it and of its tokens was sent, and
    its log-probabilities and token times not yet reported."""

    text: str = ""
    #: Incremental detokenization: text is final up to token `detok_read`; the next
    #: decode starts at `detok_prefix` so tokenizers that look back see context.
    detok_prefix: int = 0
    detok_read: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    #: With `params.logprobs`: per sampled token, [(id, logprob)] of it and its top ones.
    output_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    #: With `params.prompt_logprobs`: per prompt token after the first, collected chunk by chunk.
    prompt_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    #: When the tokens not yet in an output were sampled (a dropped stop token included).
    unreported_token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None


class OutputProcessor:
    """Output state of every unfinished request of one engine."""

    def __init__(self, decode: Callable[[list[int]], str] = lambda ids: ""):
        self.decode = decode
        self.states: dict[str, OutputState] = {}

    def add_request(self, request_id: str) -> None:
        self.states[request_id] = OutputState()

    def process(self, update: TokenUpdate) -> RequestOutput | None:
        """Apply one request's news; return its output delta (None when it sampled nothing).
        A finished delta is the request's last: its state is dropped."""
        request = update.request
        state = self.states[request.request_id]
        if update.prompt_logprobs is not None:
            state.prompt_logprobs += update.prompt_logprobs
        if update.token is None:
            return None
        state.unreported_token_times.append(update.sampled_at)
        if update.logprobs is not None:
            state.output_logprobs.append(update.logprobs)
        state.finish_reason = self._check_stop_strings(state, update)
        return self._delta(request, state)

    def finish(self, request: Request, reason: str) -> RequestOutput:
        """The last delta of a request finished from outside (an abort)."""
        state = self.states[request.request_id]
        state.finish_reason = reason
        return self._delta(request, state)

    def discard(self, request_id: str) -> None:
        """Forget a request that ends without a delta of its own (an error output)."""
        self.states.pop(request_id, None)

    def _check_stop_strings(self, state: OutputState, update: TokenUpdate) -> str | None:
        """Detokenize the new token; a stop string cuts the text there and finishes the
        request with "stop", over a token-level "length"."""
        params, output_ids = update.request.params, update.request.output_ids
        reason = update.finish_reason
        before = len(state.text)
        self.detokenize(state, output_ids, final=reason is not None)
        for stop in params.stop if len(output_ids) >= params.min_tokens else ():
            at = state.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                state.text = state.text[:at]
                reason = "stop"
        return reason

    def detokenize(self, state: OutputState, ids: list[int], final: bool = False) -> None:
        """Append the text of new tokens, decoding only a short tail (O(1) per token, not
        the whole output each step). Text ending in an incomplete character waits for more
        tokens, unless this is the request's last token."""
        prefix = self.decode(ids[state.detok_prefix : state.detok_read])
        full = self.decode(ids[state.detok_prefix :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            state.text += full[len(prefix) :]
            state.detok_prefix, state.detok_read = state.detok_read, len(ids)

    def _delta(self, request: Request, state: OutputState) -> RequestOutput:
        """The delta since the last output. Unfinished text holds back a trailing partial
        UTF-8 character and anything that could be the start of a stop string."""
        params, output_ids = request.params, request.output_ids
        finished = state.finish_reason is not None
        text = state.text
        if not finished:
            hold = max((len(s) - 1 for s in params.stop), default=0)
            visible = len(text) - hold
            while visible > 0 and text[visible - 1] == "\ufffd":
                visible -= 1
            text = text[: max(visible, state.sent_text)]
        new_text = text[state.sent_text :]
        state.sent_text = len(text)
        new_tokens = output_ids[state.sent_tokens :]
        new_logprobs = state.output_logprobs[state.sent_tokens : len(output_ids)]
        state.sent_tokens = len(output_ids)
        token_times, state.unreported_token_times = state.unreported_token_times, []
        prompt_logprobs = None
        if params.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            state.prompt_logprobs_sent = True
            prompt_logprobs = state.prompt_logprobs
        if finished:
            del self.states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(new_tokens),
            new_text=new_text,
            finished=finished,
            finish_reason=state.finish_reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(output_ids),
            new_logprobs=new_logprobs if params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            queued_at=request.queued_at,
            scheduled_at=request.scheduled_at,
            token_times=token_times,
        )


__all__ = ["OutputProcessor", "OutputState"]
