"""Gloo's dispatch and combine line on this host (`--hardware here`): measured on the gloo ranks
of `simulate.host_ranks`, after the cold weights and the elementwise lines.

Each rank runs the MoE stack's unsplit step (`tandem bench --model moe-stack`, mode `none`: the
runtime's own `torch_a2a` dispatch and combine, `TorchAllToAllPrepareAndFinalize`, between the
layers' GEMMs and elementwise ops) at a few token counts, float32, and times every dispatch
(the counts exchange, the payload, ids and weights) and combine (the send back and its sum)
where the step issues it. The time of a call on rank 0 (median over its layers and repeats)
against the bytes it moves per rank (rows sent x hidden x 4, as `OpCosts.transfer_bytes`
counts them on a host) gives a straight line: a fixed cost per call (its collectives' round
trips, the host code around them, waiting on the peer) and a cost per byte (copies and TCP on
the cores that compute).

Why inside a step: the same calls timed back to back, with nothing between them, cost a third
to a half of what they cost between a step's GEMMs (2 ranks on loopback, 64 tokens: 8 calls
9 ms on the back-to-back line, 26-28 ms timed in the step, of it ~1 ms waiting for the peer's
arrival; a busy core before the call, even a Python spin, makes it slower, a sleep does not:
the wake-ups of gloo's threads on cores that were computing). A step pays the second.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

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


class TimedAllToAll:
    """Times every dispatch (issue to received tokens) and combine (issue to the summed
    output) of the `torch_a2a` backend it wraps, as (kind, seconds, rows this rank sent), and
    when each was called (`arrivals`, `time.perf_counter`)."""

    def __init__(self, inner, calls: list[tuple[str, float, int]], arrivals: list[float] | None = None):
        self.inner, self.calls = inner, calls
        self.arrivals = arrivals if arrivals is not None else []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prepare_before_send(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        return lambda: self.prepare_async(hidden, topk_weights, topk_ids, use_fp8=use_fp8, ue8m0=ue8m0)

    def prepare_async(self, hidden, topk_weights, topk_ids, **kwargs):
        start = time.perf_counter()
        self.arrivals.append(start)
        hook, receive = self.inner.prepare_async(hidden, topk_weights, topk_ids, **kwargs)

        def received():
            tokens = receive()
            self.calls.append(("dispatch", time.perf_counter() - start, sum(tokens.handle[1])))
            return tokens

        return hook, received

    def finalize_before_send(self, expert_output, tokens, topk_weights, topk_ids):
        return lambda: self.finalize_async(expert_output, tokens, topk_weights, topk_ids)

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        start = time.perf_counter()
        self.arrivals.append(start)
        hook, receive = self.inner.finalize_async(expert_output, tokens, topk_weights, topk_ids)

        def received():
            out = receive()
            self.calls.append(("combine", time.perf_counter() - start, sum(tokens.handle[1])))
            return out

        return hook, received


def time_calls(stack, calls: list[tuple[str, float, int]], arrivals: list[float]) -> None:
    """Every kernel with transfers that the MoE stack `stack` builds from now on times them into
    `calls` and stamps their calls into `arrivals` (`TimedAllToAll`); the compute-only step's
    local kernels move nothing and are left as built."""
    build = stack._kernel

    def timed_kernel(layer, **options):
        kernel = build(layer, **options)
        if options["comm"]:
            kernel.prepare_finalize = TimedAllToAll(kernel.prepare_finalize, calls, arrivals)
        return kernel

    stack._kernel = timed_kernel


def rank_calls(rank: int, world: int, tokens: tuple[int, ...], repeat: int, warmup: int) -> tuple[dict, float]:
    """One rank: (bytes sent per rank, seconds) of each dispatch and combine size, each the
    median of its calls inside `repeat` unsplit MoE-stack steps (after `warmup` more), every
    rank stepping at once; the sizes take turns within each repeat, so a passing load touches
    them alike. Also the ranks' skew (`sync_wait`): how much later than the ranks' mean the last
    rank reaches each call, median over the calls."""
    import torch.distributed as dist

    from tandem.bench.moe_stack import MoEStack

    stack = MoEStack(rank, world, backend="torch_a2a")
    calls: list[tuple[str, float, int]] = []
    arrivals: list[float] = []
    time_calls(stack, calls, arrivals)
    by_size: dict[int, list[tuple[str, float, int]]] = {t: [] for t in tokens}
    kept_arrivals: list[float] = []
    for i in range(warmup + repeat):
        for t in tokens:
            dist.barrier()
            calls.clear()
            arrivals.clear()
            stack.step("none", t, None)
            if i >= warmup:
                by_size[t].extend(calls)
                kept_arrivals.extend(arrivals)
    hidden = STACK_SHAPE["hidden"]
    points = {kind: [(float(statistics.median(rows for k, _, rows in by_size[t] if k == kind)) * hidden * 4,
                      statistics.median(s for k, s, _ in by_size[t] if k == kind)) for t in tokens] for kind in KINDS}
    return points, sync_wait(kept_arrivals, world)


def sync_wait(arrivals: list[float], world: int) -> float:
    """The ranks' skew at their collective calls: every rank's `arrivals` (one clock: the ranks
    share a host) gathered, and per call how much later than the ranks' mean the last rank came,
    median over the calls. A rank that comes first waits that long beyond an even share, and the
    step is the last rank's (two ranks: half the gap between them)."""
    import torch.distributed as dist

    every: list = [None] * world
    dist.all_gather_object(every, arrivals)
    if len({len(a) for a in every}) != 1:
        raise ValueError(f"sync_wait: the ranks made different numbers of calls ({[len(a) for a in every]}), "
                         "so their arrivals cannot be paired")
    late = [max(call) - sum(call) / len(call) for call in zip(*every)]
    return float(statistics.median(late)) if late else 0.0


__all__ = ["KINDS", "TOKENS", "LinkFit", "TimedAllToAll", "rank_calls", "sync_wait", "time_calls"]
