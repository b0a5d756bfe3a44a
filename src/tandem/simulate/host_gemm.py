"""The GEMM figures of `here` (`simulate.host`): a short matmul on one warm weight, and the
same matmul over more distinct weights than the last-level cache holds (the cold read a step
pays, since a step reads each weight once). `simulate.host_ranks` runs the cold one on every
gloo rank at once."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tandem.bench.roofline import device_timer

#: Rows of the small GEMM that prices short GEMMs (a decode ubatch's size).
SMALL_M = 32
#: Weights the cold-weight matmul cycles over: at least this much, and 1.5x the last-level cache.
COLD_MIN_BYTES = 256 * 2**20
#: What the cold-weight figure's source says when the cold pass was not slower than the warm one.
COLD_UNRESOLVED = "not resolved: the cold pass was not slower than the warm one, priced as free"


def small_gemm_rate(size: int, repeat: int = 25) -> float:
    """FLOP/s of a [SMALL_M, size] x [size, size] float32 matmul (the best of `repeat`: each
    call is under a millisecond, so a short busy spell on the host can cover all of a few; 5
    calls once read 2.4x slow, which priced every short GEMM 1.7x dear)."""
    timed = device_timer(torch.device("cpu"))
    a, b = torch.randn(SMALL_M, size), torch.randn(size, size)
    out = torch.empty(SMALL_M, size)
    torch.mm(a, b, out=out)
    seconds = min(timed(lambda: torch.mm(a, b, out=out)) for _ in range(repeat))
    return 2.0 * SMALL_M * size * size / seconds


def last_level_cache_bytes() -> int:
    """The largest CPU cache this host reports (sysfs), 0 when it reports none."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def cold_weight_rate(size: int, *, passes: int = 7) -> tuple[float, int]:
    """(bytes per second, bytes cycled): the extra time per weight byte of a [SMALL_M, size] x
    [size, size] float32 matmul whose weight comes from memory. The matmul runs once per weight
    over more distinct weights than the last-level cache holds, and half as many times over the
    first weight alone (warm), in `passes` interleaved pairs after one pass that pages the
    weights in; the extra time is the median of the pairs' differences. The extra is small
    beside the matmul (the prefetchers hide most of the read), so it is a difference of two
    near-equal times: the best of 2 passes each gave 1.7, 13.8 and 15.3 GB/s in three runs of
    one day, as one slowed pass moved it; a pair is timed back to back, so a slow spell moves
    both of its halves. A median difference <= 0 gives an infinite rate (free; its source
    says so: `COLD_UNRESOLVED`)."""
    weight_bytes = size * size * 4
    total = max(COLD_MIN_BYTES, int(1.5 * last_level_cache_bytes()))
    weights = [torch.empty(size, size).fill_(0.01) for _ in range(-(-total // weight_bytes))]
    a, out = torch.randn(SMALL_M, size), torch.empty(SMALL_M, size)

    def cycle(over: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for w in over:
            torch.mm(a, w, out=out)
        return (time.perf_counter() - start) / len(over)

    warm_only = [weights[0]] * (len(weights) // 2)
    cycle(weights)
    extra = statistics.median(cycle(weights) - cycle(warm_only) for _ in range(passes))
    return (weight_bytes / extra if extra > 0 else float("inf")), weight_bytes * len(weights)


__all__ = ["COLD_MIN_BYTES", "COLD_UNRESOLVED", "SMALL_M", "cold_weight_rate", "last_level_cache_bytes", "small_gemm_rate"]
