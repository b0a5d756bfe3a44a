"""The time model: where a step's wall time goes.

Cheap counters (two `perf_counter` calls per transfer and per ubatch switch) that stay on:

- `recv_wait_s`: time a ubatch sat blocked waiting for a transfer to arrive (exposed
  communication);
- `comm_s`: the transfers' own duration, issue to arrival (see `add_transfer`);
- switch time: the hand-over latency from one ubatch giving up the turn to the next one
  running (counted by the executor's `Handoff`, not here).

A step's compute time is its wall time less the receive waits and the switches; the
overlap efficiency is hidden communication over total communication,
`(comm_s - recv_wait_s) / comm_s` (`overlap_efficiency`, the one definition). `StepTimes`
holds one step's (or many steps', summed) time model; `measure_step` measures one.

The counters of the running step are found through a context variable that the caller sets
around the forward (`time_model(counters)`); the ubatch executors copy the caller's
context into each ubatch, so every ubatch of one step adds to the same counters and two
runners in one process never mix theirs. Ubatches run one at a time, so plain additions
are safe.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import astuple, dataclass
from typing import Any, Callable, Iterator, Sequence

#: A wait shorter than this did not block: the data had arrived before it was asked for.
BLOCKED_THRESHOLD_S = 20e-6


@dataclass
class CommCounters:
    recv_wait_s: float = 0.0
    comm_s: float = 0.0
    transfers: int = 0
    #: The overlap timeline's recorder (`tandem.contexts.trace.Tracer`); None: not tracing.
    tracer: Any = None

    def add_transfer(self, issued: float, wait_start: float, wait_end: float, modelled_s: float | None = None) -> float:
        """One transfer issued at `issued` whose receive waited from `wait_start` to
        `wait_end` (all `perf_counter` values).

        Its duration is known exactly when the wait blocked (it arrived at `wait_end`).
        When it did not, it arrived somewhere before `wait_start`: the modelled fabric time
        is used if there is one, else `wait_start - issued`, an upper bound (so without a
        model the overlap efficiency of fully hidden transfers is counted generously).
        Returns that duration.
        """
        waited = wait_end - wait_start
        if waited > BLOCKED_THRESHOLD_S or modelled_s is None:
            duration = wait_end - issued
        else:
            duration = max(modelled_s, waited)
        self.recv_wait_s += waited
        self.comm_s += duration
        self.transfers += 1
        return duration

    def add_blocking(self, seconds: float) -> None:
        """A synchronous collective: all of it is communication, none of it hidden."""
        self.recv_wait_s += seconds
        self.comm_s += seconds
        self.transfers += 1


def overlap_efficiency(comm_s: float, recv_wait_s: float) -> float:
    """Hidden communication over total communication (0 when there was none)."""
    return max(comm_s - recv_wait_s, 0.0) / comm_s if comm_s > 0 else 0.0


@dataclass
class StepTimes:
    """Where the wall time of one step (or of many, summed) went: the time model.

    `recv_wait_s` is communication left exposed (blocked receives and synchronous
    collectives), `switch_s` the ubatch hand-over latency, `compute_s` the rest;
    `comm_s` is the transfers' own duration, hidden or not.
    """

    step_s: float = 0.0
    compute_s: float = 0.0
    recv_wait_s: float = 0.0
    comm_s: float = 0.0
    switch_s: float = 0.0

    @property
    def hidden_comm_s(self) -> float:
        return max(self.comm_s - self.recv_wait_s, 0.0)

    @property
    def overlap_efficiency(self) -> float:
        return overlap_efficiency(self.comm_s, self.recv_wait_s)

    def __add__(self, other: "StepTimes") -> "StepTimes":
        return StepTimes(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[float, ...]:
        return astuple(self)

    def with_blocking(self, seconds: float) -> "StepTimes":
        """These times plus a synchronous collective of `seconds` run as part of the step."""
        return StepTimes(self.step_s + seconds, self.compute_s, self.recv_wait_s + seconds, self.comm_s + seconds, self.switch_s)

    @staticmethod
    def mean(times: Sequence["StepTimes"]) -> "StepTimes":
        total = sum(times, StepTimes())
        return StepTimes(*(v / len(times) for v in total.as_tuple()))


class MeasuredStep:
    """What `measure_step` measured: `times` is set when its block exits, raised or not."""

    times: StepTimes | None = None


@contextmanager
def measure_step(executor, tracer=None, **trace_tags) -> Iterator[MeasuredStep]:
    """Measure the step run inside this block: its wall time, the transfers it counts (this
    block is their time model) and the ubatch switches of `executor` (whatever runs the
    ubatches: it counts `switch_time_s`). With a `tracer`, the step goes on the timeline
    with `trace_tags`."""
    counters = CommCounters(tracer=tracer)
    measured = MeasuredStep()
    switch_before = executor.switch_time_s
    start = time.perf_counter()
    try:
        with time_model(counters):
            yield measured
    finally:
        elapsed = time.perf_counter() - start
        if tracer is not None:
            tracer.step(start, start + elapsed, **trace_tags)
        switch = executor.switch_time_s - switch_before
        measured.times = StepTimes(
            step_s=elapsed,
            compute_s=max(elapsed - counters.recv_wait_s - switch, 0.0),
            recv_wait_s=counters.recv_wait_s,
            comm_s=counters.comm_s,
            switch_s=switch,
        )


_COUNTERS: ContextVar[CommCounters | None] = ContextVar("tandem_time_model", default=None)


def current_comm_counters() -> CommCounters | None:
    return _COUNTERS.get()


@contextmanager
def time_model(counters: CommCounters) -> Iterator[CommCounters]:
    """Count the transfers of the forward run inside this block into `counters`."""
    token = _COUNTERS.set(counters)
    try:
        yield counters
    finally:
        _COUNTERS.reset(token)


def timed_receive(wait: Callable[[], None], modelled_s: float | None = None) -> Callable[[], None]:
    """Wrap the wait of a transfer issued now so its timing is counted; `wait` itself when
    no counters are active (zero cost)."""
    counters = _COUNTERS.get()
    if counters is None:
        return wait
    issued = time.perf_counter()
    tracer = counters.tracer
    issuer = None if tracer is None else tracer.current_ubatch()

    def timed() -> None:
        start = time.perf_counter()
        try:
            wait()
        finally:
            end = time.perf_counter()
            duration = counters.add_transfer(issued, start, end, modelled_s)
            if tracer is not None:
                tracer.transfer(issuer, issued, issued + duration, start, end)

    return timed


@contextmanager
def timed_blocking() -> Iterator[None]:
    """Count a synchronous collective run inside this block."""
    counters = _COUNTERS.get()
    if counters is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        counters.add_blocking(end - start)
        if counters.tracer is not None:
            counters.tracer.collective(start, end)


__all__ = [
    "CommCounters",
    "MeasuredStep",
    "StepTimes",
    "current_comm_counters",
    "measure_step",
    "overlap_efficiency",
    "time_model",
    "timed_blocking",
    "timed_receive",
]
