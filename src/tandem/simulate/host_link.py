"""Gloo's dispatch and combine line on this host (`--hardware here`): measured on the gloo ranks
of `simulate.host_ranks`, after the cold weights and the elementwise lines.

Each rank runs the runtime's own `torch_a2a` dispatch and combine (`TorchAllToAllPrepareAndFinalize`:
the counts exchange, the payload, ids and weights, the combine back) at a few token counts, float32 payloads, uniform top-k routing. The time of
each call on rank 0 (median of its repeats) against the bytes it moves per rank (rows sent x
hidden x 4, as `OpCosts.transfer_bytes` counts them on a host) gives a straight line: a fixed
cost per call (its collectives' round trips, the host code around them, waiting on the peer)
and a cost per byte (copies and TCP on the cores that compute).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from tandem.bench.moe_stack import STACK_SHAPE
from tandem.simulate.line_fit import UNRESOLVED, fit_rates, unresolved

KINDS = ("dispatch", "combine")
#: Tokens per rank of the measured calls: a decode ubatch to a large prefill.
TOKENS = (16, 128, 512)


@dataclass(frozen=True)
class LinkFit:
    """Per kind: seconds fixed per call and bytes per second after that; `points` are the
    measured (bytes per rank, seconds) pairs the line goes through."""

    fixed_s: dict[str, float]
    bytes_per_s: dict[str, float]
    points: dict[str, list[tuple[float, float]]]

    @classmethod
    def from_points(cls, points: dict[str, list[tuple[float, float]]]) -> LinkFit:
        return cls(*fit_rates(points), points)

    @classmethod
    def copies(cls, bytes_per_s: float) -> LinkFit:
        """No fixed cost, bytes at a copy's rate (what the profile assumed before it measured)."""
        return cls({k: 0.0 for k in KINDS}, {k: bytes_per_s for k in KINDS}, {k: [] for k in KINDS})

    def describe(self, kind: str) -> str:
        pts = ", ".join(f"{b / 1e6:.2f} MB {s * 1e3:.2f} ms" for b, s in self.points[kind])
        if not pts:
            return f"{kind}: not measured"
        return f"{kind}: {pts} ({UNRESOLVED})" if kind in unresolved(self.points) else f"{kind}: {pts}"


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.full((tokens, top_k), 1.0 / top_k), ids


def rank_calls(rank: int, world: int, tokens: tuple[int, ...], repeat: int, warmup: int) -> dict:
    """One rank: (bytes sent per rank, seconds) of each dispatch and combine size, median of
    `repeat`; the sizes take turns within each repeat, so a passing load touches them alike."""
    import torch.distributed as dist

    from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize

    hidden, experts, top_k = STACK_SHAPE["hidden"], STACK_SHAPE["experts"], STACK_SHAPE["top_k"]
    pf = TorchAllToAllPrepareAndFinalize(experts)
    gen = torch.Generator().manual_seed(rank)
    inputs = [(torch.randn(t, hidden, generator=gen), *_routing(t, experts, top_k, gen)) for t in tokens]
    times = {(kind, t): [] for kind in KINDS for t in tokens}
    sent = {}
    dist.barrier()
    for i in range(warmup + repeat):
        for t, (x, weights, ids) in zip(tokens, inputs):
            start = time.perf_counter()
            _, receive = pf.prepare_async(x, weights, ids, use_fp8=False)
            received = receive()
            dispatched = time.perf_counter()
            _, back = pf.finalize_async(received.hidden, received, weights, ids)
            back()
            if i >= warmup:
                times["dispatch", t].append(dispatched - start)
                times["combine", t].append(time.perf_counter() - dispatched)
            sent[t] = sum(received.handle[1])  # rows this rank sent (and gets back)
    return {kind: [(float(sent[t] * hidden * 4), statistics.median(times[kind, t])) for t in tokens] for kind in KINDS}


__all__ = ["KINDS", "TOKENS", "LinkFit", "rank_calls"]
