"""A modelled interconnect: each rank's link is one queue, and a transfer completes at
max(issue, link free) + latency + bytes / bandwidth.

On one CPU machine the gloo transport shares the cores with compute, so it cannot show what
overlap buys on a real fabric. With a model, the real transfer still happens (results stay
exact) but its completion is held back to the modelled time by sleeping on a timer, which
costs no CPU: a waiting rank's core is free for the other ubatch's (or rank's) compute.

The byte count is what the backend actually moves on this rank (its send buffers: token
rows in the model's dtype, plus top-k ids and weights for `torch_a2a`; the whole static
`[R, E_local, T, H]` buffer for `torch_a2a_ll`; the valid (token, expert) rows for the
DeepEP adapters), so the modelled time scales with the payload.

Presets (`--fabric NAME`) reproduce DeepEP's published low-latency figures on H800 with
CX7 400 Gb/s InfiniBand (128 tokens per rank, hidden 7168, top-8, FP8 dispatch, BF16
combine): each EP size's dispatch and combine points are fitted exactly by one
latency + bytes / bandwidth line, taking the payload DeepEP moves per rank (every token
once per selected expert: 7168 FP8 bytes + 56 float32 scales for dispatch, 7168 BF16
values for combine).

The link queue: a rank's transfers (sends and receives alike) are served one after the
other, so two in flight at once share the link (the second finishes one transfer time
after the first) instead of each getting the whole bandwidth, and no overlap schedule can
beat max(compute, communication). An all-to-all moves its send and its receive payload in
the two directions of a full-duplex link at once: it holds the link for latency + the
larger of the two / bandwidth, so a balanced exchange costs what DeepEP's figures (fitted
on the per-rank payload) say and the presets keep their fitted numbers.

Limits: no congestion, topology, incast or message-size-dependent efficiency; each rank
models only its own link (a peer's busy link does not delay this rank's receive); the real
gloo transfer underneath still costs CPU; and a Python `time.sleep` overshoots by tens of
microseconds (timer slack), so latencies below ~100 µs are approximate. A graph replay does not run the Python wait, so the model only
applies to eager steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

#: DeepEP's low-latency kernels on H800 (legacy V1 README, "Low-latency kernels with pure
#: RDMA"): EP size -> (dispatch µs, combine µs) at 128 tokens/rank, hidden 7168, top-8.
DEEPEP_LL_H800_US: dict[int, tuple[float, float]] = {
    8: (77.0, 114.0),
    16: (118.0, 195.0),
    32: (155.0, 273.0),
    64: (173.0, 314.0),
    128: (192.0, 369.0),
    256: (194.0, 360.0),
}
#: Bytes one rank sends in that setting: 128 tokens x 8 experts x row bytes.
DEEPEP_LL_DISPATCH_BYTES = 128 * 8 * (7168 + 7168 // 128 * 4)  # FP8 rows + float32 scales per 128
DEEPEP_LL_COMBINE_BYTES = 128 * 8 * 7168 * 2  # BF16 rows


def _fit(dispatch_us: float, combine_us: float) -> tuple[float, float]:
    """The (latency µs, GB/s) line through both published points."""
    bytes_per_us = (DEEPEP_LL_COMBINE_BYTES - DEEPEP_LL_DISPATCH_BYTES) / (combine_us - dispatch_us)
    latency_us = dispatch_us - DEEPEP_LL_DISPATCH_BYTES / bytes_per_us
    return latency_us, bytes_per_us * 1e6 / 1e9


#: `--fabric` presets: name -> (latency µs, GB/s). `deepep-ll-h800` is EP8.
FABRIC_PRESETS: dict[str, tuple[float, float]] = {
    f"deepep-ll-h800-ep{ep}": _fit(*points) for ep, points in DEEPEP_LL_H800_US.items()
}
FABRIC_PRESETS["deepep-ll-h800"] = FABRIC_PRESETS["deepep-ll-h800-ep8"]


class LinkQueue:
    """One rank's link: transfers are served in issue order, each after the previous one
    has finished. Thread-safe (ubatch threads issue transfers)."""

    def __init__(self) -> None:
        self._free_at = float("-inf")
        self._lock = threading.Lock()

    def reserve(self, issued: float, duration_s: float) -> float:
        """Queue a transfer issued at `issued` that holds the link `duration_s`; its finish time."""
        if duration_s < 0:
            raise ValueError(f"a transfer cannot take negative time, got {duration_s} s")
        with self._lock:
            finish = max(issued, self._free_at) + duration_s
            self._free_at = finish
        return finish


@dataclass(frozen=True)
class FabricModel:
    latency_s: float
    bytes_per_s: float
    #: This rank's link; each model instance has its own (one per rank process).
    link: LinkQueue = field(default_factory=LinkQueue, compare=False, repr=False)

    @classmethod
    def from_flags(
        cls, latency_us: float | None, gbps: float | None, preset: str | None = None
    ) -> "FabricModel | None":
        """`--fabric-latency-us` and `--fabric-gbps` (gigabytes per second), or `--fabric
        PRESET` (not both); None if none is set."""
        if preset is not None:
            if latency_us is not None or gbps is not None:
                raise ValueError("--fabric takes a preset; do not combine it with --fabric-latency-us / --fabric-gbps")
            return cls.from_preset(preset)
        if latency_us is None and gbps is None:
            return None
        latency_us = 0.0 if latency_us is None else float(latency_us)
        if latency_us < 0:
            raise ValueError(f"fabric latency must be >= 0 µs, got {latency_us}")
        if gbps is not None and gbps <= 0:
            raise ValueError(f"fabric bandwidth must be > 0 GB/s, got {gbps}")
        return cls(latency_us * 1e-6, float("inf") if gbps is None else gbps * 1e9)

    @classmethod
    def from_preset(cls, name: str) -> "FabricModel":
        if name not in FABRIC_PRESETS:
            raise ValueError(f"unknown --fabric preset {name!r}; known: {', '.join(sorted(FABRIC_PRESETS))}")
        latency_us, gbps = FABRIC_PRESETS[name]
        return cls(latency_us * 1e-6, gbps * 1e9)

    @property
    def latency_us(self) -> float:
        return self.latency_s * 1e6

    @property
    def gbps(self) -> float:
        return self.bytes_per_s / 1e9

    def describe(self) -> str:
        return f"{self.latency_us:.1f} µs + bytes / {self.gbps:.3g} GB/s"

    def transfer_time(self, nbytes: int) -> float:
        """How long a transfer of `nbytes` holds the link (no queueing)."""
        return self.latency_s + nbytes / self.bytes_per_s

    def start(self, sent_bytes: int, received_bytes: int = 0, *, issued: float | None = None) -> float:
        """Queue a transfer issued now (or at `issued`) that sends `sent_bytes` and receives
        `received_bytes` on this rank's link; its finish time (a `perf_counter` value)."""
        issued = time.perf_counter() if issued is None else issued
        return self.link.reserve(issued, self.transfer_time(max(sent_bytes, received_bytes)))

    @staticmethod
    def wait_until(deadline: float) -> None:
        """Block until `deadline` (a `time.perf_counter()` value) by sleeping, never spinning."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


__all__ = ["DEEPEP_LL_H800_US", "FABRIC_PRESETS", "FabricModel", "LinkQueue"]
