"""`--comm-sms N`: while ubatches overlap on a GPU, communication kernels (DeepEP) get N
SMs and compute kernels (DeepGEMM) the rest, so neither starves the other; the previous
settings come back afterwards. On CPU there are no SMs and the setting does nothing."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from tandem.platform.device import sm_count


def _loaded(name: str):
    """The library if it is already imported: a backend in use imports its library when it
    is built, so one that is not loaded is not in use. Never imported from here (importing
    DeepEP or DeepGEMM initialises NCCL checks and JIT state, and a failing import would be
    retried at every step)."""
    return sys.modules.get(name)


def _deep_ep_sms(comm_sms: int) -> int:
    """DeepEP's high-throughput buffers are sized for the SM count in force when they were
    made: more SMs would overflow them, so the count is capped there (as vLLM does)."""
    from tandem.modular_kernels.prepare_deepep import ht_buffer_sms_limit

    limit = ht_buffer_sms_limit()
    return comm_sms if limit is None else min(comm_sms, limit)


@contextlib.contextmanager
def comm_sm_partition(comm_sms: int | None, *, total_sms: int | None = None) -> Iterator[None]:
    """Reserve `comm_sms` SMs for communication inside the block.

    `total_sms` defaults to the current CUDA device's SM count; without a device (and no
    explicit count) this is a no-op. DeepEP requires an even SM count and gets at most what
    its buffers were sized for; DeepGEMM gets the rest, rounded down to an even count
    (every GEMM asserts one).
    """
    total = total_sms if total_sms is not None else sm_count()
    if not comm_sms or total is None:
        yield
        return
    if not 0 < comm_sms < total - 1:
        raise ValueError(f"--comm-sms must lie in [2, {total - 2}] on a device with {total} SMs, got {comm_sms}")
    if comm_sms % 2:
        raise ValueError(f"--comm-sms must be even (DeepEP splits SMs in pairs), got {comm_sms}")
    deep_ep = _loaded("deep_ep")
    deep_gemm = _loaded("deep_gemm")
    restore = []
    try:
        if deep_ep is not None:
            restore.append((deep_ep.Buffer.set_num_sms, deep_ep.Buffer.num_sms))
            deep_ep.Buffer.set_num_sms(_deep_ep_sms(comm_sms))
        if deep_gemm is not None:
            restore.append((deep_gemm.set_num_sms, deep_gemm.get_num_sms()))
            deep_gemm.set_num_sms((total - comm_sms) // 2 * 2)
        yield
    finally:
        for setter, previous in reversed(restore):
            setter(previous)
