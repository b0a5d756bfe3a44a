"""The time model: where a step's wall time goes.

Cheap counters (two `perf_counter` calls per transfer and per ubatch switch) that stay on:

- `recv_wait_s`: time a ubatch sat blocked waiting for a transfer to arrive (exposed
  communication);
- `comm_s`: the transfers' own duration, issue to arrival (see `add_transfer`);
- switch time: the hand-over latency from one ubatch giving up the turn to the next one
  running (counted by the executor's `Handoff`, not here).

A step's compute time is its wall time less the receive waits and the switches; the
overlap efficiency is hidden communication over total communication,
`(comm_s - recv_wait_s) / comm_s`.

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
from dataclasses import dataclass
from typing import Any, Callable, Iterator

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


__all__ = ["CommCounters", "current_comm_counters", "time_model", "timed_blocking", "timed_receive"]
