"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A request's own random stream on `device` (where its logits are sampled): the same
        seed gives the same tokens whatever else is in the batch."""
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (0-d int64 on the logits' device) from one row of logits `[V]`, with no
    host read: every choice that depends on values is made on the device."""
    greedy = logits.argmax()
    if params.greedy:
        return greedy
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    # A temperature so small that logits / temperature overflows: the limit is greedy.
    finite = torch.isfinite(probs).all()
    probs = torch.where(finite, probs, torch.zeros_like(probs).scatter_(0, greedy.view(1), 1.0))
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        outside[0] = False  # even when top_p underflows the dtype (top_p=5e-324 is 0 in float32)
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.where(finite, torch.multinomial(probs, 1, generator=generator)[0], greedy)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """`logits [R, V]`, one row per request → token ids `[R]` int64 on the logits' device."""
    if not params:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    return torch.stack([sample_token(row, p, g) for row, p, g in zip(logits, params, generators)])


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """`sample_token` read back to the host."""
    return int(sample_token(logits, params, generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """`sample_tokens` read back to the host."""
    return sample_tokens(logits, params, generators).tolist()
