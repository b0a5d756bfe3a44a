"""What `here` measures on its gloo ranks, in the same run: gloo's dispatch and combine between
them, the rate a GEMM reads cold weights while every rank streams its own, and the elementwise
lines of `host_elementwise` while every rank measures its own.

Two (or `ranks`) processes join a gloo group over loopback, as `tandem bench` ranks do (one
intra-op thread each). Each first times `host_gemm.cold_weight_rate` at once (the ranks of a step
stream their weights together, sharing the memory system) and, when asked, the elementwise
lines, then they run the runtime's own `torch_a2a` dispatch and combine (`TorchAllToAllPrepareAndFinalize`: the counts exchange, the payload, ids and weights, the
combine back) at a few token counts, float32 payloads, uniform top-k routing. The time of
each call on rank 0 (median of its repeats) against the bytes it moves per rank (rows sent x
hidden x 4, as `OpCosts.transfer_bytes` counts them on a host) gives a straight line: a fixed
cost per call (its collectives' round trips, the host code around them, waiting on the peer)
and a cost per byte (copies and TCP on the cores that compute).
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.bench.moe_stack import STACK_SHAPE
from tandem.simulate.line_fit import fit_line

if TYPE_CHECKING:
    from tandem.simulate.host_elementwise import ElementwiseFit

KINDS = ("dispatch", "combine")
#: Tokens per rank of the measured calls: a decode ubatch to a large prefill.
TOKENS = (16, 128, 512)


@dataclass(frozen=True)
class RankMeasurements:
    """What `measure_ranks` measured: the transfer line, rank 0's cold-weight read rate
    (bytes/s) over `cycled` bytes of weights while every rank cycled its own, and rank 0's
    elementwise lines while every rank measured its own (None: not measured)."""

    link: "LinkFit"
    cold_rate: float
    cycled: int
    ranks: int
    elementwise: "ElementwiseFit | None" = None


@dataclass(frozen=True)
class LinkFit:
    """Per kind: seconds fixed per call and bytes per second after that; `points` are the
    measured (bytes per rank, seconds) pairs the line goes through."""

    fixed_s: dict[str, float]
    bytes_per_s: dict[str, float]
    points: dict[str, list[tuple[float, float]]]

    @classmethod
    def from_points(cls, points: dict[str, list[tuple[float, float]]]) -> "LinkFit":
        fixed, rates = {}, {}
        for kind, pairs in points.items():
            intercept, slope = fit_line(pairs)
            fixed[kind], rates[kind] = max(intercept, 0.0), 1.0 / slope if slope > 0 else float("inf")
        return cls(fixed, rates, points)

    @classmethod
    def copies(cls, bytes_per_s: float) -> "LinkFit":
        """No fixed cost, bytes at a copy's rate (what the profile assumed before it measured)."""
        return cls({k: 0.0 for k in KINDS}, {k: bytes_per_s for k in KINDS}, {k: [] for k in KINDS})

    def describe(self, kind: str) -> str:
        pts = ", ".join(f"{b / 1e6:.2f} MB {s * 1e3:.2f} ms" for b, s in self.points[kind])
        return f"{kind}: {pts}" if pts else f"{kind}: not measured"


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.full((tokens, top_k), 1.0 / top_k), ids


def _rank_cold_rate(size: int) -> tuple[float, int]:
    """This rank's `host_gemm.cold_weight_rate`, every rank at once (after a barrier)."""
    import torch.distributed as dist

    from tandem.simulate.host_gemm import cold_weight_rate

    dist.barrier()
    return cold_weight_rate(size)


def _rank_elementwise() -> dict:
    """This rank's `host_elementwise.measure_elementwise` points, every rank at once (after a barrier)."""
    import torch.distributed as dist

    from tandem.simulate.host_elementwise import measure_elementwise

    dist.barrier()
    return measure_elementwise().points


def _rank_calls(rank: int, world: int, tokens: tuple[int, ...], repeat: int, warmup: int) -> dict:
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


def measure_ranks(ranks: int, *, matmul_size: int = 1024, tokens: tuple[int, ...] = TOKENS, repeat: int = 9,
                  warmup: int = 3, timeout_s: float = 120.0, elementwise: bool = False) -> RankMeasurements:
    """Measure on `ranks` gloo processes (rank 0's figures): the cold-weight read rate of a
    `matmul_size`-wide matmul (0: not measured), with `elementwise` the lines of
    `host_elementwise.measure_elementwise`, every rank at once, and the dispatch and combine line.
    The ranks are fresh interpreters (`python -m tandem.simulate.host_link`), so a caller's own
    script is never re-run in them."""
    import os
    import subprocess
    import sys

    from tandem.distributed.launch import find_free_port

    world = max(ranks, 2)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": str(world)}
    argv = [sys.executable, "-m", "tandem.simulate.host_link", ",".join(map(str, tokens)), str(repeat), str(warmup),
            str(matmul_size), str(int(elementwise))]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"the gloo transfer measurement's rank {rank} failed (exit {proc.returncode}):\n{err[-2000:]}")
            outputs.append(out)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the gloo transfer measurement did not finish within {timeout_s:g} s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
    doc = json.loads(outputs[0])
    link = LinkFit.from_points({k: [tuple(p) for p in v] for k, v in doc["points"].items()})
    fit = None
    if doc["elementwise"] is not None:
        from tandem.simulate.host_elementwise import ElementwiseFit

        fit = ElementwiseFit.from_points({k: [tuple(p) for p in v] for k, v in doc["elementwise"].items()},
                                         f"each of {world} gloo ranks at once (rank 0's figure)")
    return RankMeasurements(link, doc["cold"][0], doc["cold"][1], world, fit)


def _main(argv: list[str]) -> None:
    """One rank of `measure_ranks` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); rank 0
    prints its points as JSON."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        size = int(argv[3])
        cold = _rank_cold_rate(size) if size else (0.0, 0)
        elementwise = _rank_elementwise() if int(argv[4]) else None
        points = _rank_calls(rank, world, tuple(int(t) for t in argv[0].split(",")), int(argv[1]), int(argv[2]))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"points": points, "cold": cold, "elementwise": elementwise}))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])


__all__ = ["KINDS", "LinkFit", "RankMeasurements", "TOKENS", "fit_line", "measure_ranks"]
