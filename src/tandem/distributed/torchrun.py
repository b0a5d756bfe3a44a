"""Running a command's per-rank function as one rank that torchrun started (env://
rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the way `launch_ranks` runs it in
local processes: every rank calls `fn(rank, world_size, *args)`; rank 0 gets every rank's
result in rank order, the others get None."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist

from tandem.distributed.launch import cpu_group, init_rank


def under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and (
        "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    )


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when torchrun started this process, else None."""
    if not under_torchrun():
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run_torchrun_rank(
    fn: Callable[..., Any], *args, world_size: int, device="auto", timeout_s: float = 600.0
) -> list | None:
    """`world_size` is what the command's flags ask for; it must be torchrun's."""
    rank, torchrun_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != torchrun_size:
        raise ValueError(f"the flags ask for {world_size} ranks but torchrun started WORLD_SIZE={torchrun_size}")
    init_rank(rank, torchrun_size, device=device, timeout_s=timeout_s)
    try:
        result = fn(rank, torchrun_size, *args)
        gathered = [None] * torchrun_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=cpu_group())
        return gathered
    finally:
        dist.destroy_process_group()


__all__ = ["run_torchrun_rank", "torchrun_world", "under_torchrun"]
