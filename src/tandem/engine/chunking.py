"""Dynamic chunking for long prompts (SGLang's chunked pipeline prefill).

With a fixed chunk size, every chunk of a long prompt costs more than the one before: its
attention reads the whole prefix. Under pipeline parallelism, chunks of one prompt follow each
other through the stages, so a growing cost means growing bubbles. Dynamic chunking fits the
prefill latency of a fresh sequence of `l` tokens, `f(l) = a l^2 + b l + c`, once at start-up,
and then gives a request with `L` tokens already computed the chunk `x` that costs what the
base chunk costs from an empty prefix: `f(L + x) - f(L) = f(base) - f(0)`, i.e. the positive
root of `a x^2 + (2 a L + b) x - (a base^2 + b base) = 0`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence


def fit_quadratic(lengths: Sequence[int], seconds: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares `(a, b, c)` of `seconds ~ a l^2 + b l + c` (needs three distinct lengths)."""
    import numpy as np

    if len(set(lengths)) < 3 or len(lengths) != len(seconds):
        raise ValueError("fitting a quadratic latency model needs timings at three or more distinct lengths")
    a, b, c = np.polyfit(np.asarray(lengths, dtype=float), np.asarray(seconds, dtype=float), 2)
    return float(a), float(b), float(c)


@dataclass(frozen=True)
class DynamicChunker:
    """`chunker(L)`: the chunk size for a request with `L` tokens computed."""

    a: float
    b: float
    c: float
    base: int
    granularity: int = 16
    min_chunk: int = 16

    def __call__(self, computed: int) -> int:
        a, b, base = self.a, self.b, self.base
        target = a * base * base + b * base  # f(base) - f(0)
        if a <= 0 or target <= 0:
            return base  # no quadratic growth measured (or a fit lost in noise): fixed chunks
        linear = 2 * a * computed + b
        x = (-linear + math.sqrt(linear * linear + 4 * a * target)) / (2 * a)
        x = int(x) // self.granularity * self.granularity
        return max(self.min_chunk, min(base, x))


def profile_prefill(run_prefill: Callable[[int], None], lengths: Sequence[int], repeat: int = 2) -> list[float]:
    """The fastest of `repeat` timings of `run_prefill(l)` for each length."""
    timings = []
    for length in lengths:
        best = math.inf
        for _ in range(repeat):
            start = time.perf_counter()
            run_prefill(length)
            best = min(best, time.perf_counter() - start)
        timings.append(best)
    return timings


def profile_lengths(base: int, max_len: int) -> list[int]:
    """Lengths to time: around the base chunk and up to 4x it, within the context."""
    lengths = sorted({max(16, min(max_len, n)) for n in (base // 2, base, 2 * base, 4 * base)})
    return lengths


def fit_chunker(runner, base: int, forward: Callable[[list], object] | None = None) -> DynamicChunker:
    """Time prefills of fresh sequences through `forward(chunks)` (default: the runner's own
    step, sampling nothing), fit the latency model and return its `DynamicChunker`. On
    several DP ranks every rank calls this at the same point (the forwards are collective)."""
    from tandem.worker.step_inputs import ScheduledChunk
    from tandem.worker.kv_cache import blocks_needed
    from tandem.worker.sampling import SamplingParams

    if forward is None:
        def forward(chunks):
            return runner.execute(chunks, [SamplingParams()], [None], finishes_prompt=[False])

    block_size = runner.block_size
    usable = (runner.allocator.num_free - 1) * block_size
    lengths = profile_lengths(base, min(runner.info.max_model_len - 1, usable))

    def prefill(length: int) -> None:
        blocks = runner.allocator.allocate(blocks_needed(length, block_size))
        try:
            forward([ScheduledChunk([1] * length, 0, blocks)])
        finally:
            runner.allocator.free(blocks)

    a, b, c = fit_quadratic(lengths, profile_prefill(prefill, lengths))
    return DynamicChunker(a, b, c, base=base, granularity=block_size, min_chunk=max(block_size, base // 8))


__all__ = ["DynamicChunker", "fit_chunker", "fit_quadratic", "profile_lengths", "profile_prefill"]
