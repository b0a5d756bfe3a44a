"""A modelled interconnect: a receive completes no earlier than its issue time plus
latency plus bytes / bandwidth.

On one CPU machine the gloo transport shares the cores with compute, so it cannot show what
overlap buys on a real fabric. With a model, the real transfer still happens (results stay
exact) but its completion is held back to the modelled time by sleeping, which costs no CPU.
The model ignores congestion, topology and compute/communication contention on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FabricModel:
    latency_s: float
    bytes_per_s: float

    @classmethod
    def from_flags(cls, latency_us: float | None, gbps: float | None) -> "FabricModel | None":
        """`--fabric-latency-us` and `--fabric-gbps` (gigabytes per second); None if unset."""
        if latency_us is None and gbps is None:
            return None
        latency_us = 0.0 if latency_us is None else float(latency_us)
        if latency_us < 0:
            raise ValueError(f"fabric latency must be >= 0 µs, got {latency_us}")
        if gbps is not None and gbps <= 0:
            raise ValueError(f"fabric bandwidth must be > 0 GB/s, got {gbps}")
        return cls(latency_us * 1e-6, float("inf") if gbps is None else gbps * 1e9)

    def transfer_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def start(self, nbytes: int) -> float:
        """Deadline of a transfer of `nbytes` issued now."""
        return time.perf_counter() + self.transfer_time(nbytes)

    @staticmethod
    def wait_until(deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
