"""Run a function on N local processes joined in a gloo group on loopback, with every wait
bounded: a rank that raises, dies or hangs fails the call with its traceback, never a hang."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


class DistributedTestError(RuntimeError):
    pass


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, results, timeout_s) -> None:
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list:
    """Call `fn(rank, world_size, *args)` on each rank; return the results in rank order.

    `fn` must be picklable (a module-level function). Collectives inside get `timeout_s`
    too, so a rank blocked on a dead peer errors out instead of waiting forever.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(rank, world_size, port, fn, args, results, timeout_s), daemon=True
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish within {timeout_s:g} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    raise DistributedTestError(
                        f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}"
                    ) from None
                continue
            outcomes[rank] = (ok, value)
            if not ok:
                raise DistributedTestError(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outcomes[r][1] for r in range(world_size)]
