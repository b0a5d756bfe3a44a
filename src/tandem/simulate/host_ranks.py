"""The gloo ranks `here` measures on, in the same run: the rate a GEMM reads cold weights while
every rank streams its own (`host_gemm`), the elementwise lines while every rank measures its own
(`host_elementwise`), and gloo's dispatch and combine line between them (`host_link`: each call
timed inside the MoE stack's unsplit step, as a step pays it).

Two (or `ranks`) fresh interpreters (`python -m tandem.simulate.host_ranks`, so a caller's own
script is never re-run in them) join a gloo group over loopback, as `tandem bench` ranks do (one
intra-op thread each), and run the three in that order, every rank at once; rank 0 prints its
figures. `run_ranks` waits for all of them against one deadline, polling each: the first rank
that fails is reported with its own stderr (each rank writes to a file, so none stalls on a
full pipe), and every rank is killed on every way out.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.simulate.host_link import TOKENS, LinkFit, rank_calls

if TYPE_CHECKING:
    from tandem.simulate.host_elementwise import ElementwiseFit

#: Seconds between two looks at the ranks while they run.
POLL_S = 0.05


@dataclass(frozen=True)
class RankMeasurements:
    """What `measure_ranks` measured: the transfer line, rank 0's cold-weight read rate
    (bytes/s) over `cycled` bytes of weights while every rank cycled its own, and rank 0's
    elementwise lines while every rank measured its own (None: not measured)."""

    link: LinkFit
    cold_rate: float
    cycled: int
    ranks: int
    elementwise: ElementwiseFit | None = None


def run_ranks(argvs: list[list[str]], envs: list[dict[str, str]], *, timeout_s: float, what: str) -> list[str]:
    """Run one process per rank (`argvs[r]` with `envs[r]`) and return each one's stdout once all
    exit 0. Raises RuntimeError naming the first rank seen failing (its exit status and the end of
    its stderr), or the ranks still running at `timeout_s` (one deadline for all of them); every
    rank still alive is killed on the way out."""
    outs = [tempfile.TemporaryFile(mode="w+") for _ in argvs]
    errs = [tempfile.TemporaryFile(mode="w+") for _ in argvs]
    procs: list[subprocess.Popen] = []
    try:
        for argv, env, out, err in zip(argvs, envs, outs, errs):
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True))
        _wait(procs, errs, time.monotonic() + timeout_s, timeout_s, what)
        return [_read(out) for out in outs]
    finally:
        _stop(procs)
        for f in outs + errs:
            f.close()


def _wait(procs: list[subprocess.Popen], errs: list, deadline: float, timeout_s: float, what: str) -> None:
    while True:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                raise RuntimeError(f"{what}: rank {rank} failed first (exit {code}):\n{_read(errs[rank])[-2000:]}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            raise RuntimeError(f"{what} did not finish within {timeout_s:g} s (ranks {running} still running)")
        time.sleep(POLL_S)


def _read(file) -> str:
    file.flush()
    file.seek(0)
    return file.read()


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill every rank still alive and reap it; never raises (the caller's error stays the one reported)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def measure_ranks(ranks: int, *, matmul_size: int = 1024, tokens: tuple[int, ...] = TOKENS, repeat: int = 5,
                  warmup: int = 2, timeout_s: float = 120.0, elementwise: bool = False) -> RankMeasurements:
    """Measure on `ranks` gloo processes (rank 0's figures): the cold-weight read rate of a
    `matmul_size`-wide matmul (0: not measured), with `elementwise` the lines of
    `host_elementwise.measure_elementwise`, every rank at once, and the dispatch and combine line;
    all of it within `timeout_s`."""
    from tandem.distributed.launch import find_free_port

    world = max(ranks, 2)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": str(world)}
    argv = [sys.executable, "-m", "tandem.simulate.host_ranks", ",".join(map(str, tokens)), str(repeat), str(warmup),
            str(matmul_size), str(int(elementwise))]
    outputs = run_ranks([argv] * world, [{**env, "RANK": str(r)} for r in range(world)], timeout_s=timeout_s,
                        what="the gloo ranks' measurement (cold weights, elementwise lines, transfers)")
    doc = json.loads(outputs[0])
    link = LinkFit.from_points({k: [tuple(p) for p in v] for k, v in doc["points"].items()})
    fit = None
    if doc["elementwise"] is not None:
        from tandem.simulate.host_elementwise import ElementwiseFit

        fit = ElementwiseFit.from_points({k: [tuple(p) for p in v] for k, v in doc["elementwise"].items()},
                                         f"each of {world} gloo ranks at once (rank 0's figure)")
    return RankMeasurements(link, doc["cold"][0], doc["cold"][1], world, fit)


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


def _main(argv: list[str]) -> None:
    """One rank of `measure_ranks` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set); rank 0
    prints its points as JSON."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        size = int(argv[3])
        cold = _rank_cold_rate(size) if size else (0.0, 0)
        elementwise = _rank_elementwise() if int(argv[4]) else None
        points, _ = rank_calls(rank, world, tuple(int(t) for t in argv[0].split(",")), int(argv[1]), int(argv[2]))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"points": points, "cold": cold, "elementwise": elementwise}))


if __name__ == "__main__":
    _main(sys.argv[1:])


__all__ = ["POLL_S", "RankMeasurements", "measure_ranks", "run_ranks"]
