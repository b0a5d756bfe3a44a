"""The scheduler loop around each mode's step: the normal loop against the overlapped one.

The engine's step has CPU work outside the forward (`engine/core.py`): `Scheduler.schedule`
(the next batch, its KV blocks), then `Engine._apply` on the step's tokens (the scheduler's
bookkeeping, stop checks, `OutputProcessor` detokenizing, freeing a finished request's KV).
The normal loop runs that work and the forward in sequence. The overlapped loop hands step N
to its forward thread and applies step N-1's tokens, then schedules step N+1 (its inputs name
N's tokens by `FutureMap` placeholders), while N's forward runs; the forward thread takes
N+1 as soon as N is done, so in the steady state the host's work of a step runs beside the
device's work of another, and the loop's step is the longer of the two.

The host work is one figure a step, in seconds, given by the user (`--host-step-ms`): the
engine's per-step work has a part per request (each scheduled request's chunk, each output's
stop check and detokenization), but tandem has no public GPU measurement of either part, so
the simulator takes the whole step's figure as given rather than invent a split. Without it
the loop is not simulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.simulate.hardware import HardwareProfile


def host_step_seconds(host_step_ms: float) -> float:
    """`--host-step-ms` in seconds; a negative or non-finite figure is refused (ValueError)."""
    if not math.isfinite(host_step_ms) or host_step_ms < 0:
        raise ValueError(f"--host-step-ms must be a finite number of milliseconds >= 0, got {host_step_ms}")
    return host_step_ms * 1e-3


@dataclass(frozen=True)
class SchedulerLoops:
    """One mode's step under both loops, `host_s` of CPU work a step beside its `device_s`.

    `hides_host`: the device is separate from the host that schedules (a GPU profile), so the
    overlapped loop's step is max(device, host). On a host whose cores do the compute
    (`transfers_on_compute`: `--hardware here`) the forward's threads hold every core, and the
    overlapped loop's second thread takes its cores from the forward (`SchedulerConfig.
    overlaps_schedule`: it stalls the forward at each parallel region), so nothing is hidden
    and its step is device + host, as the normal loop's (measured on this CPU across the runs of
    benchmarks/README.md: 0.93-0.99x the normal loop, the host work 0.6-0.7 % of a step)."""

    device_s: float
    host_s: float
    tokens: float
    hides_host: bool

    @property
    def normal_s(self) -> float:
        return self.device_s + self.host_s

    @property
    def overlapped_s(self) -> float:
        return max(self.device_s, self.host_s) if self.hides_host else self.normal_s

    @property
    def normal_tokens_per_s(self) -> float:
        return self.tokens / self.normal_s

    @property
    def overlapped_tokens_per_s(self) -> float:
        return self.tokens / self.overlapped_s

    @property
    def speedup(self) -> float:
        """The overlapped loop's speed-up over the normal one."""
        return self.normal_s / self.overlapped_s


def scheduler_loops(device_s: float, tokens: float, host_s: float, hw: HardwareProfile) -> SchedulerLoops:
    """A mode's step of `device_s` under both loops on `hw`."""
    return SchedulerLoops(device_s, host_s, tokens, hides_host=not hw.transfers_on_compute)


def format_loops(sim) -> str:
    """The loops' table under `format_table`'s, or the one line saying they were not simulated."""
    if sim.host_step_s is None:
        return "scheduler loop: not simulated (give --host-step-ms, the engine's CPU work a step outside the forward)"
    where = "overlapped beside the device" if not sim.hardware.transfers_on_compute else "on the computing cores: not hidden"
    head = f"scheduler loop, {sim.host_step_s * 1e3:.2f} ms host work a step (given; {where})"
    rows = [f"{'mode':<22}{'normal ms':>10}{'tok/s/GPU':>12}{'overlap ms':>12}{'tok/s/GPU':>12}{'vs normal':>10}"]
    for r in sim.results:
        loop = r.loops
        rows.append(f"{r.mode:<22}{loop.normal_s * 1e3:>10.2f}{loop.normal_tokens_per_s:>12.0f}"
                    f"{loop.overlapped_s * 1e3:>12.2f}{loop.overlapped_tokens_per_s:>12.0f}{loop.speedup:>9.2f}x")
    return "\n".join([head, *rows])


__all__ = ["SchedulerLoops", "format_loops", "host_step_seconds", "scheduler_loops"]
