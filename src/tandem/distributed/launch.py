"""Start data-parallel ranks as local processes joined in one torch.distributed group
(env:// rendezvous, as `torchrun` sets it up), with every wait bounded: a rank that raises,
dies or hangs fails the launch with its traceback instead of hanging the parent.

Each rank has two groups over the same ranks, chosen by the device it runs on: the default
(device) group for tensor collectives, NCCL on CUDA and gloo on CPU, and a gloo CPU group
for the control plane and metadata (step decisions, timing gathers), which are CPU tensors
whatever the device. On CPU both are the default gloo group.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.platform.device import available_cores


class RankFailedError(RuntimeError):
    pass


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: This process's gloo CPU group, made by `init_rank` (a process joins one default group).
_CPU_GROUP: dist.ProcessGroup | None = None


def local_rank(rank: int) -> int:
    """The rank's index on its host: torchrun's LOCAL_RANK, else the global rank (local launch)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def local_world_size(world_size: int) -> int:
    """How many ranks share this host: torchrun's LOCAL_WORLD_SIZE, else all of them (local launch)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def init_rank(
    rank: int, world_size: int, *, device: str | torch.device = "cpu", timeout_s: float = 120.0
) -> torch.device:
    """Join the group described by MASTER_ADDR / MASTER_PORT (env:// rendezvous) with the
    backend of this rank's device (`--device` value or a resolved device), and make the
    gloo CPU group. Returns the rank's device."""
    global _CPU_GROUP
    from tandem.platform.device import CPU_GROUP_BACKEND, device_group_backend, resolve_device

    if not isinstance(device, torch.device):
        device = resolve_device(device, local_rank(rank))
    backend = device_group_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    _CPU_GROUP = None if backend == CPU_GROUP_BACKEND else dist.new_group(backend=CPU_GROUP_BACKEND)
    return device


def cpu_group() -> dist.ProcessGroup | None:
    """The gloo group for CPU tensors (control plane, metadata) of this rank: the default
    group when that is gloo, else the one `init_rank` made; None without a process group."""
    if not dist.is_initialized():
        return None
    return _CPU_GROUP if _CPU_GROUP is not None else dist.group.WORLD


def threads_per_rank(world_size: int) -> int:
    """Each spawned rank's `OMP_NUM_THREADS`: `$OMP_NUM_THREADS` when set, else the cores this
    process may run on shared out among the ranks (at least one). One rank on a 2-core
    machine streams its weights on both cores: a decode step reads every weight once, and one
    core alone reaches about half the memory bandwidth."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, available_cores() // world_size)


def use_thread_env(env: dict) -> None:
    """Apply a spawned rank's `OMP_NUM_THREADS`: the child imported torch (unpickling its
    arguments) before it could set the variable, so torch kept one thread per core, and two
    ranks on a 2-core machine then fight over the cores (pipeline stages ran 15x slower)."""
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _rank_main(rank, world_size, env, fn, args, results, timeout_s, device) -> None:
    try:
        use_thread_env(env)
        init_rank(rank, world_size, device=device, timeout_s=timeout_s)
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def launch_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0, device: str = "cpu"
) -> list:
    """Call `fn(rank, world_size, *args)` in `world_size` processes; return the results in
    rank order. `fn` must be picklable (module level). Collectives get `timeout_s` too.
    `device` (`--device` value) picks each rank's device and so its group backend."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": str(threads_per_rank(world_size))}
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, env, fn, args, results, timeout_s, device), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, Any] = {}
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(set(range(world_size)) - set(outcomes))
                raise RankFailedError(f"rank(s) {late} did not finish within {timeout_s:g} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    codes = [procs[i].exitcode for i in dead]
                    raise RankFailedError(f"rank(s) {dead} died with exit codes {codes}") from None
                continue
            if not ok:
                raise RankFailedError(f"rank {rank} failed:\n{value}")
            outcomes[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outcomes[r] for r in range(world_size)]
