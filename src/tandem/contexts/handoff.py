"""Turn passing among the ubatches of one run.

Exactly one ubatch holds the turn at any time; a yield passes it to the next unfinished
ubatch in round-robin order, and the last ubatch to finish hands control back to the
caller. One `Handoff` exists per run, so concurrent runs never share state.

Failure protocol: a ubatch that raises records its error and finishes normally, passing
the turn on; every other ubatch then raises `UBatchAborted` where it resumes, finishes,
and passes the turn on, until the caller gets control back and re-raises the error. Only
a stalled run (no handover for `timeout` seconds) wakes everybody at once, because the
holder of the turn cannot be trusted to pass it on.
"""

from __future__ import annotations

import threading
import time

from tandem.contexts.errors import UBatchAborted, UBatchTimeoutError

#: How often a blocked waiter wakes to check whether the run is still making progress.
_WATCHDOG_POLL_S = 0.25


class Handoff:
    shares_thread: bool = False
    #: The run's timeline recorder (`tandem.contexts.trace.RunTrace`), set by the executor;
    #: None when not tracing.
    tracer = None

    def __init__(self, num_ubatches: int, timeout: float):
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.num_ubatches = num_ubatches
        self.timeout = float(timeout)
        self.finished = [False] * num_ubatches
        self.holder: int | None = 0
        self.switches = 0
        #: Hand-over latency summed over the switches: from one ubatch giving up the turn to
        #: the next one running (an OS wake-up and a GIL hand-over for threads).
        self.switch_time_s = 0.0
        self._handed_over_at: float | None = None
        self.aborted = False
        self.error: BaseException | None = None
        self.failed_ubatch: int | None = None
        self._failure_lock = threading.Lock()

    def next_alive(self, ubatch_id: int) -> int | None:
        n = self.num_ubatches
        for step in range(1, n):
            candidate = (ubatch_id + step) % n
            if not self.finished[candidate]:
                return candidate
        return None

    def record_failure(self, ubatch_id: int | None, error: BaseException) -> bool:
        """Abort the run with `error` unless it already failed; True if this call won."""
        with self._failure_lock:
            if self.error is not None:
                return False
            self.error, self.failed_ubatch, self.aborted = error, ubatch_id, True
            return True

    def check_aborted(self) -> None:
        if self.aborted:
            raise UBatchAborted(f"another ubatch failed: {self.error!r}")

    def _mark_handover(self) -> None:
        self._handed_over_at = time.perf_counter()

    def _mark_resumed(self) -> None:
        if self._handed_over_at is not None:
            now = time.perf_counter()
            self.switch_time_s += now - self._handed_over_at
            if self.tracer is not None:
                self.tracer.switch(self.holder, self._handed_over_at, now)
            self._handed_over_at = None

    def wait_turn(self, ubatch_id: int) -> None:
        raise NotImplementedError

    def yield_turn(self, ubatch_id: int) -> None:
        raise NotImplementedError

    def finish(self, ubatch_id: int) -> None:
        raise NotImplementedError


def _release(lock: threading.Lock) -> None:
    # Only an aborted run can release a lock twice (abort wakes everyone); that is harmless.
    try:
        lock.release()
    except RuntimeError:
        pass


class ThreadHandoff(Handoff):
    """One OS thread per ubatch; each blocks on its own lock until handed the turn.

    Plain `threading.Lock`s are the cheapest cross-thread wake-up Python has (an `Event`
    or a `Condition` adds a second lock and a Python-level wait loop).
    """

    def __init__(self, num_ubatches: int, timeout: float):
        super().__init__(num_ubatches, timeout)
        self._turn = [threading.Lock() for _ in range(num_ubatches)]
        for lock in self._turn[1:]:
            lock.acquire()
        self._done = threading.Lock()
        self._done.acquire()

    def wait_turn(self, ubatch_id: int) -> None:
        self._wait(self._turn[ubatch_id])
        self._mark_resumed()
        self.check_aborted()

    def yield_turn(self, ubatch_id: int) -> None:
        target = self.next_alive(ubatch_id)
        if target is None:
            self.check_aborted()
            return
        self.holder = target
        self.switches += 1
        self._mark_handover()
        _release(self._turn[target])
        self.wait_turn(ubatch_id)

    def finish(self, ubatch_id: int) -> None:
        self.finished[ubatch_id] = True
        target = self.next_alive(ubatch_id)
        self.holder = target
        self.switches += 1
        if target is not None:
            self._mark_handover()
        _release(self._done if target is None else self._turn[target])

    def wait_done(self) -> None:
        """Block the caller until every ubatch finished or the run stalled."""
        self._wait(self._done)

    def abort(self, error: BaseException) -> None:
        """Fail the run from outside the turn order and wake every waiter."""
        self.record_failure(self.holder, error)
        for lock in self._turn:
            _release(lock)
        _release(self._done)

    def _wait(self, lock: threading.Lock) -> None:
        if lock.acquire(timeout=min(self.timeout, _WATCHDOG_POLL_S)):
            return
        seen, since = self.switches, time.monotonic()
        while not lock.acquire(timeout=min(self.timeout, _WATCHDOG_POLL_S)):
            if self.switches != seen:
                seen, since = self.switches, time.monotonic()
            elif time.monotonic() - since >= self.timeout:
                stuck = self.holder
                self.abort(UBatchTimeoutError(stuck if stuck is not None else -1, self.timeout))
                return

    def wait_finished(self, grace_s: float) -> list[int]:
        """After an abort: wait up to `grace_s` for every ubatch to unwind; return the
        ids of those that did not (their threads are lost to this run)."""
        deadline = time.monotonic() + grace_s
        while not all(self.finished) and time.monotonic() < deadline:
            time.sleep(0.005)
        return [i for i, done in enumerate(self.finished) if not done]


class GreenletHandoff(Handoff):
    """All ubatches on one OS thread: a yield is a direct greenlet switch, nothing blocks.

    The executor sets `greenlets` and drives `holder` until it becomes None.
    """

    shares_thread = True

    def __init__(self, num_ubatches: int, timeout: float):
        super().__init__(num_ubatches, timeout)
        self.greenlets: list | None = None

    def wait_turn(self, ubatch_id: int) -> None:
        if self.greenlets is None:
            raise RuntimeError(
                "greenlet ubatch contexts run only under a GreenletExecutor "
                "(run_ubatches(..., executor='greenlet'))"
            )
        self._mark_resumed()
        self.check_aborted()

    def yield_turn(self, ubatch_id: int) -> None:
        target = self.next_alive(ubatch_id)
        if target is not None:
            self.holder = target
            self.switches += 1
            self._mark_handover()
            self.greenlets[target].switch()
            self._mark_resumed()
        self.check_aborted()

    def finish(self, ubatch_id: int) -> None:
        # Returning from the greenlet lands in the executor, which switches to `holder`.
        self.finished[ubatch_id] = True
        self.holder = self.next_alive(ubatch_id)
        self.switches += 1
        if self.holder is not None:
            self._mark_handover()
