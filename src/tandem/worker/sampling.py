"""Token sampling on the logits' device, batched over the step's requests.

Per step, in vLLM's order: raw log-probabilities for the requests that asked for them (before
any of the processing below, vLLM's default `raw_logprobs`), then `min_tokens` (end tokens
masked until that many tokens were sampled), the repetition / frequency / presence penalties,
the grammar mask of requests constrained to a JSON schema (`tandem.worker.grammar`), then
greedy argmax, or temperature, `min_p`, `top_k`, `top_p` and a draw by inverse CDF: one
uniform number per row from the request's own seeded stream on the host (`random.Random`, so
a seeded request's tokens do not depend on the batch), then one cumulative sum and one search
for the whole step. Every choice that depends on values is made on the device: nothing here
reads a device value on the host. (`torch.multinomial` with a generator per request cost one
call per row: 32 sampled rows of a 2,048-token vocabulary took 3.4 ms on the CPU, more than
the tiny Mixtral's decode step; 0.28 ms now, `benchmarks/sampling_step.py`.)

A request's state across steps (its random stream, how many tokens it sampled, its output token
counts for the penalties) is a `RequestSampler`, made once per request by
`SamplingParams.make_sampler` and passed to every `sample_tokens` call that samples for it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from tandem.platform import cpu_kernels
from tandem.worker.grammar import GrammarConstraint, mask_logits

#: Most top log-probabilities one token may ask for (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20


class RandomStream(Protocol):
    """Where a request's uniform draws come from (`random.Random`)."""

    def random(self) -> float: ...


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    #: End tokens (eos unless ignore_eos, stop_token_ids) and stop strings are held off until
    #: this many tokens were generated.
    min_tokens: int = 0
    #: vLLM's meanings: logits of tokens seen in the prompt or output are divided (if > 0) or
    #: multiplied (if < 0) by `repetition_penalty`; `frequency_penalty * count` and
    #: `presence_penalty * (count > 0)` are subtracted, counting generated tokens only.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: Log-probabilities of each sampled token and of this many most likely ones (None: none).
    logprobs: int | None = None
    #: The output must be JSON matching this JSON schema (JSON text), by constrained decoding
    #: (`tandem.worker.grammar`); its end token ends the request whatever `ignore_eos` says.
    json_schema: str | None = None
    #: vLLM's `prompt_logprobs`: of each prompt token after the first given the tokens before
    #: it, and of this many most likely ones at its place (None: none). Raw model
    #: log-probabilities, from the forward that prefills the prompt.
    prompt_logprobs: int | None = None
    #: OpenAI's `logit_bias`: token id -> a value in [-100, 100] added to its logit before
    #: penalties, constraints and sampling (raw log-probabilities do not see it).
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must lie in [0, {MAX_LOGPROBS}], got {value}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not -100 <= bias <= 100:  # also false for NaN
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias} for token {token}")
        if self.json_schema is not None and self.min_tokens:
            # Holding the end token back could leave a finished document no token to take.
            raise ValueError("min_tokens cannot be combined with a JSON schema constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def penalizes_prompt(self) -> bool:
        """True when sampling reads the prompt: the repetition penalty counts its tokens."""
        return self.repetition_penalty != 1.0

    def make_stream(self) -> random.Random | None:
        """A request's own random stream: the same seed gives the same tokens whatever else is
        in the batch, on any device (the draws are made on the host and sent with the step)."""
        if self.greedy:
            return None
        return random.Random(self.seed if self.seed is not None else random.getrandbits(62))

    def make_sampler(self, prompt_ids: Sequence[int] = (), eos_token_ids: Sequence[int] = ()) -> RequestSampler:
        """The request's sampling state; `prompt_ids` feed the repetition penalty and
        `eos_token_ids` the `min_tokens` mask."""
        end_ids = list(self.stop_token_ids) + ([] if self.ignore_eos else list(eos_token_ids))
        return RequestSampler(
            stream=self.make_stream(),
            prompt_ids=list(prompt_ids) if self.penalizes_prompt else [],
            end_token_ids=sorted(set(end_ids)) if self.min_tokens else [],
        )


@dataclass
class RequestSampler:
    """One request's sampling state across steps (see the module docstring)."""

    stream: RandomStream | None = None
    prompt_ids: list[int] = field(default_factory=list)
    end_token_ids: list[int] = field(default_factory=list)
    #: Tokens sampled so far (counted on the host as they are drawn: no device read).
    num_sampled: int = 0
    #: `[V]` int32 on the device: how often each token was generated (penalized requests only).
    output_counts: torch.Tensor | None = None
    #: `[V]` bool on the device: tokens of the prompt (repetition penalty only).
    prompt_mask: torch.Tensor | None = None
    #: The request's grammar state (`SamplingParams.json_schema` only), advanced on the host by
    #: `structured.advance_constraints` after each step.
    constraint: GrammarConstraint | None = None

    def _ensure_counts(self, vocab_size: int, device: torch.device) -> None:
        if self.output_counts is not None:
            return
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        ids = [t for t in self.prompt_ids if 0 <= t < vocab_size]
        if ids:
            self.prompt_mask[torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)] = True


@dataclass
class SampleOutput:
    """A step's samples on the device. `logprobs`/`logprob_ids` are `[R, 1 + K]` (the sampled
    token first, then the K most likely, K the largest any row asked for) when some row asked
    for log-probabilities, else None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    logprob_ids: torch.Tensor | None = None


def _as_sampler(state: RequestSampler | RandomStream | None) -> RequestSampler:
    if isinstance(state, RequestSampler):
        return state
    return RequestSampler(stream=state)  # a bare stream: a request with no state to keep


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _mask_end_tokens(logits: torch.Tensor, params, samplers: list[RequestSampler]) -> None:
    rows, cols = [], []
    vocab = logits.shape[-1]
    for r, (p, s) in enumerate(zip(params, samplers)):
        if s.num_sampled < p.min_tokens:
            ids = [t for t in s.end_token_ids if 0 <= t < vocab]
            rows += [r] * len(ids)
            cols += ids
    if rows:
        device = logits.device
        logits.index_put_((_to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device)),
                          torch.tensor(float("-inf"), device=device))


def _add_logit_bias(logits: torch.Tensor, params) -> None:
    """Each request's `logit_bias` added to its row: one indexed add for the whole step, its
    indices built on the host from the parameters (nothing kept across steps)."""
    vocab = logits.shape[-1]  # the front end checks ids against the tokenizer's vocabulary
    entries = [(r, t, bias) for r, p in enumerate(params) for t, bias in (p.logit_bias or {}).items() if t < vocab]
    if not entries:
        return
    rows, tokens, biases = zip(*entries)
    device = logits.device
    index = (_to_device(list(rows), torch.int64, device), _to_device(list(tokens), torch.int64, device))
    logits.index_put_(index, _to_device(list(biases), torch.float32, device), accumulate=True)


def _apply_penalties(logits: torch.Tensor, params, samplers: list[RequestSampler]) -> None:
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    for r in rows:
        samplers[r]._ensure_counts(vocab, device)
    index = _to_device(rows, torch.int64, device)
    counts = torch.stack([samplers[r].output_counts for r in rows])
    seen = torch.stack([samplers[r].prompt_mask for r in rows]) | (counts > 0)
    repetition = _to_device([params[r].repetition_penalty for r in rows], torch.float32, device)[:, None]
    frequency = _to_device([params[r].frequency_penalty for r in rows], torch.float32, device)[:, None]
    presence = _to_device([params[r].presence_penalty for r in rows], torch.float32, device)[:, None]
    picked = logits[index]
    picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
    picked = picked - frequency * counts - presence * (counts > 0)
    logits[index] = picked


def _sample_rows(logits: torch.Tensor, params, samplers) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p and a draw, batched; greedy rows take their argmax."""
    device, vocab = logits.device, logits.shape[-1]
    greedy = [p.greedy for p in params]
    if _only_temperature(params, vocab) and cpu_kernels.takes(logits):
        # One kernel call for the whole draw, where the torch ops below are ~15 calls of a few
        # microseconds each on rows this small (a tenth of a tiny model's decode step).
        temperatures = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        return cpu_kernels.sample(logits, temperatures, _uniforms(greedy, samplers))
    temperature = _to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device)
    scores = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = _to_device([p.min_p for p in params], torch.float32, device)[:, None]
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if any(0 < p.top_k < vocab for p in params):
        k = _to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        kth = scores.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = _to_device([p.top_p for p in params], torch.float32, device)[:, None]
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token, even
        # when top_p underflows the dtype: top_p=5e-324 is 0 in float32).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        outside[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(outside, 0.0))
    return _draw(probs, _argmax(logits), greedy, samplers)


def _only_temperature(params, vocab: int) -> bool:
    """No row cuts its distribution (min_p, top_k, top_p): a softmax at a temperature is all."""
    return not any(p.min_p > 0 or 0 < p.top_k < vocab or p.top_p < 1.0 for p in params)


def _uniforms(greedy: list[bool], samplers) -> list[float]:
    """Each sampled row's draw from its request's stream (0 for greedy rows, which draw none)."""
    streams = [random if s.stream is None else s.stream for s in samplers]
    return [0.0 if g else st.random() for g, st in zip(greedy, streams)]


def _draw(probs: torch.Tensor, greedy_ids: torch.Tensor, greedy: list[bool], samplers) -> torch.Tensor:
    """Each row's token by inverse CDF: the first whose cumulative mass passes the row's uniform
    draw (scaled by the row's total, which top-p leaves below 1)."""
    uniforms = _to_device(_uniforms(greedy, samplers), torch.float32, probs.device)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # A uniform near 1 times the total may round to the total: stay strictly below it, so the
    # search lands on a token with mass.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    # A temperature so small that logits / temperature overflows leaves NaN mass: the limit
    # is greedy.
    take_greedy = ~torch.isfinite(total[:, 0])
    if any(greedy):
        take_greedy |= _to_device(greedy, torch.bool, probs.device)
    return torch.where(take_greedy, greedy_ids, drawn)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, the first maximum of each row, as `max`'s indices: on the CPU
    `argmax` over a row is 2-4x slower (60 against 25 us for [32, 2048] here)."""
    return logits.max(-1).indices


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (fp32 log-softmax of `logits [R, V]`) of `token_ids [R]`, then of
    each row's `top` most likely tokens: `(values, ids)`, both `[R, 1 + top]`, on the device."""
    logprobs = logits.float().log_softmax(-1)
    ids = token_ids[:, None]
    if top:
        ids = torch.cat([ids, logprobs.topk(top, -1).indices], dim=1)
    return logprobs.gather(1, ids), ids


def sample_step(
    logits: torch.Tensor, params: Sequence[SamplingParams], samplers: Sequence[RequestSampler | RandomStream | None]
) -> SampleOutput:
    """`logits [R, V]`, one row per request, → the step's `SampleOutput` on the logits' device.
    `samplers[r]` is request r's `RequestSampler` (a bare random stream, or None for a greedy
    request, when it keeps no state across steps)."""
    device = logits.device
    if not params:
        return SampleOutput(torch.empty(0, dtype=torch.int64, device=device))
    states = [_as_sampler(s) for s in samplers]
    wants_logprobs = any(p.logprobs is not None for p in params)
    raw = logits
    constrained = [r for r, s in enumerate(states) if s.constraint is not None]
    if constrained or any(p.min_tokens or p.penalized or p.logit_bias for p in params):
        logits = logits.to(torch.float32, copy=True)  # the processing below writes in place
        _add_logit_bias(logits, params)
        _mask_end_tokens(logits, params, states)
        _apply_penalties(logits, params, states)
        if constrained:
            mask_logits(logits, constrained, [states[r].constraint for r in constrained])
    tokens = _argmax(logits) if all(p.greedy for p in params) else _sample_rows(logits.float(), params, states)
    for r, (p, s) in enumerate(zip(params, states)):
        s.num_sampled += 1
        if p.penalized:
            s.output_counts.index_add_(0, tokens[r : r + 1], torch.ones(1, dtype=torch.int32, device=device))
    if not wants_logprobs:
        return SampleOutput(tokens)
    values, ids = token_logprobs(raw, tokens, max(p.logprobs or 0 for p in params))
    return SampleOutput(tokens, values, ids)


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], samplers: Sequence[RequestSampler | RandomStream | None]
) -> torch.Tensor:
    """`sample_step(...)`'s token ids `[R]` int64 on the logits' device."""
    return sample_step(logits, params, samplers).tokens


def sample_token(logits: torch.Tensor, params: SamplingParams, sampler) -> torch.Tensor:
    """One token id (0-d int64 on the logits' device) from one row of logits `[V]`."""
    return sample_tokens(logits[None], [params], [sampler])[0]


def sample_one(logits: torch.Tensor, params: SamplingParams, sampler) -> int:
    """`sample_token` read back to the host."""
    return int(sample_token(logits, params, sampler))


def sample(logits: torch.Tensor, params: list[SamplingParams], samplers) -> list[int]:
    """`sample_tokens` read back to the host."""
    return sample_tokens(logits, params, samplers).tolist()
