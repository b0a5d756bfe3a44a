"""Run a test function on N local gloo ranks on loopback, every wait bounded (see
`tandem.distributed.launch`)."""

from __future__ import annotations

from typing import Any, Callable

from tandem.distributed.launch import RankFailedError, find_free_port, launch_ranks

DistributedTestError = RankFailedError


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list:
    """Call `fn(rank, world_size, *args)` on each rank; return the results in rank order."""
    return launch_ranks(fn, world_size, *args, timeout_s=timeout_s)


__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
