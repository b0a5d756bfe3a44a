"""The device's roofline, measured in the run that uses it: memory bandwidth from a large
copy (read + write) and from a large sum (read only: what streaming weights does, and faster
than a copy on a GPU), and the matmul rate from a large square matmul in the model's dtype. The peaks a data
sheet promises are not what kernels reach; a floor is only honest against what this device,
under this load, actually did."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Roofline:
    device: str
    dtype: str
    #: Bytes read + written per second by a large device-to-device copy.
    bandwidth_bytes_per_s: float
    #: Bytes read per second by a large sum (no writes): the rate a weight stream can reach.
    read_bandwidth_bytes_per_s: float
    #: Multiply-adds x 2 per second of a large square matmul in `dtype`.
    matmul_flops_per_s: float
    copy_bytes: int
    matmul_size: int

    def floor_s(self, bytes_moved: float, flops: float) -> float:
        """The least time this much traffic and arithmetic can take here."""
        return max(bytes_moved / self.bandwidth_bytes_per_s, flops / self.matmul_flops_per_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "bandwidth_gb_per_s": self.bandwidth_bytes_per_s / 1e9,
                "read_bandwidth_gb_per_s": self.read_bandwidth_bytes_per_s / 1e9,
                "matmul_tflops": self.matmul_flops_per_s / 1e12}


def device_timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call of `fn` takes on `device`: CUDA events on a GPU, the wall clock on
    the CPU (where ops are synchronous)."""
    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        return timed

    def timed_on_host(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed_on_host


def _best(timed, fn, repeat: int) -> float:
    fn()  # first touch: allocation, library init
    return min(timed(fn) for _ in range(repeat))


def measure_roofline(device: torch.device, dtype: torch.dtype, *, copy_mib: int | None = None,
                     matmul_size: int | None = None, repeat: int = 5) -> Roofline:
    """Bandwidth and matmul rate of `device` (the best of `repeat` runs each: a peak).
    Defaults: 1 GiB copies and an 8192-wide matmul on a GPU, 64 MiB and 1024 on the CPU."""
    on_gpu = device.type == "cuda"
    copy_mib = copy_mib or (1024 if on_gpu else 64)
    matmul_size = matmul_size or (8192 if on_gpu else 1024)
    timed = device_timer(device)
    src = torch.empty(copy_mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = _best(timed, lambda: dst.copy_(src), repeat)
    del src, dst
    # Floats of 1.0, not the copy's bytes: bytes viewed as floats would be denormals, slow on a CPU.
    stream = torch.ones(copy_mib * 2**18, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    read_s = _best(timed, lambda: torch.sum(stream, dim=0, out=total), repeat)
    del stream
    a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
    b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
    out = torch.empty_like(a)
    matmul_s = _best(timed, lambda: torch.mm(a, b, out=out), repeat)
    return Roofline(
        device=str(device), dtype=str(dtype).removeprefix("torch."),
        bandwidth_bytes_per_s=2 * copy_mib * 2**20 / copy_s,
        read_bandwidth_bytes_per_s=copy_mib * 2**20 / read_s,
        matmul_flops_per_s=2 * matmul_size**3 / matmul_s,
        copy_bytes=copy_mib * 2**20, matmul_size=matmul_size,
    )


__all__ = ["Roofline", "device_timer", "measure_roofline"]
