"""Turn passing among the ubatches of one run.

Exactly one ubatch holds the turn at any time; a yield passes it to the next unfinished
ubatch in round-robin order, and the last ubatch to finish hands control back to the
caller. One `Handoff` exists per run, so concurrent runs never share state.

A yield is on the eager path of every MoE layer, so it does only what a switch needs: each
ubatch has a `Turn` that already knows its successor in the ring (relinked when a ubatch
finishes or the run aborts, never searched at a yield), takes one hand-over timing, and
switches.

Failure protocol: a ubatch that raises records its error and finishes normally, passing
the turn on; every other ubatch then raises `UBatchAborted` where it resumes, finishes,
and passes the turn on, until the caller gets control back and re-raises the error. Only
a stalled run (no handover for `timeout` seconds) wakes everybody at once, because the
holder of the turn cannot be trusted to pass it on.
"""

from __future__ import annotations

import threading
import time
from time import perf_counter

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
        #: The ubatch the turn goes to after a finish (the one resumed next); thread runs
        #: also keep it current at every yield, to name a stalled ubatch.
        self.holder: int | None = 0
        self.switches = 0
        #: Hand-over latency summed over the switches: from one ubatch giving up the turn to
        #: the next one running (an OS wake-up and a GIL hand-over for threads).
        self.switch_time_s = 0.0
        #: `perf_counter()` at the latest hand-over, read by the ubatch it went to.
        self.handed_over_at: float | None = None
        self.aborted = False
        self.error: BaseException | None = None
        self.failed_ubatch: int | None = None
        self._failure_lock = threading.Lock()
        self._link_lock = threading.Lock()
        #: `successor[i]`: the next unfinished ubatch after ubatch i, None when i is the last.
        self.successor: list[int | None] = [None] * num_ubatches
        self.turns = [self._new_turn(i) for i in range(num_ubatches)]
        self._relink()

    def _new_turn(self, ubatch_id: int) -> "Turn":
        raise NotImplementedError

    def _link(self, turn: "Turn", successor: int | None) -> None:
        """Point `turn` at the ubatch its yields hand to (None: a yield does not switch)."""
        raise NotImplementedError

    def _relink(self) -> None:
        # The only search of the ring: at a finish or an abort, never at a yield.
        with self._link_lock:
            n, finished = self.num_ubatches, self.finished
            for i in range(n):
                self.successor[i] = next(
                    (j % n for j in range(i + 1, i + n) if not finished[j % n]), None
                )
            for turn in self.turns:
                # After an abort nobody switches any more: a yield raises at once.
                linked = not (self.aborted or finished[turn.id])
                self._link(turn, self.successor[turn.id] if linked else None)

    def next_alive(self, ubatch_id: int) -> int | None:
        return self.successor[ubatch_id]

    def record_failure(self, ubatch_id: int | None, error: BaseException) -> bool:
        """Abort the run with `error` unless it already failed; True if this call won."""
        with self._failure_lock:
            if self.error is not None:
                return False
            self.error, self.failed_ubatch, self.aborted = error, ubatch_id, True
        self._relink()
        return True

    def aborted_error(self) -> UBatchAborted:
        return UBatchAborted(f"another ubatch failed: {self.error!r}")

    def check_aborted(self) -> None:
        if self.aborted:
            raise self.aborted_error()

    def _count_first_resume(self, ubatch_id: int) -> None:
        # A ubatch's first turn: ubatch 0's comes from the caller, not from a hand-over.
        if self.handed_over_at is not None:
            now = perf_counter()
            self.switch_time_s += now - self.handed_over_at
            if self.tracer is not None:
                self.tracer.switch(ubatch_id, self.handed_over_at, now)

    def wait_turn(self, ubatch_id: int) -> None:
        """Block the entering ubatch until its first turn."""
        raise NotImplementedError

    def finish(self, ubatch_id: int) -> None:
        raise NotImplementedError


class Turn:
    """One ubatch's end of the handoff; `pass_()` is its yield."""

    __slots__ = ("handoff", "id")

    def __init__(self, handoff: Handoff, ubatch_id: int):
        self.handoff = handoff
        self.id = ubatch_id

    def pass_(self) -> None:
        raise NotImplementedError


class ThreadTurn(Turn):
    __slots__ = ("lock", "successor")

    def __init__(self, handoff: Handoff, ubatch_id: int):
        super().__init__(handoff, ubatch_id)
        #: Held while this ubatch waits for the turn; released by whoever hands it over.
        self.lock = threading.Lock()
        self.successor: ThreadTurn | None = None

    def pass_(self) -> None:
        handoff, successor = self.handoff, self.successor
        if successor is None:
            handoff.check_aborted()
            return
        handoff.holder = successor.id
        handoff.switches += 1
        handoff.handed_over_at = perf_counter()
        # Nothing between the release and the acquire (not even a helper's return): the
        # woken thread needs the GIL, which this one gives up only when it blocks here.
        try:
            successor.lock.release()
        except RuntimeError:  # released already: only by an abort, which wakes everyone
            pass
        if not self.lock.acquire(True, handoff.poll_s):
            handoff.wait_stalled(self.lock)
        if handoff.aborted:
            raise handoff.aborted_error()
        now = perf_counter()
        handoff.switch_time_s += now - handoff.handed_over_at
        if handoff.tracer is not None:
            handoff.tracer.switch(self.id, handoff.handed_over_at, now)


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
        self.poll_s = min(float(timeout), _WATCHDOG_POLL_S)
        super().__init__(num_ubatches, timeout)
        for turn in self.turns[1:]:
            turn.lock.acquire()
        self._done = threading.Lock()
        self._done.acquire()

    def _new_turn(self, ubatch_id: int) -> ThreadTurn:
        return ThreadTurn(self, ubatch_id)

    def _link(self, turn: ThreadTurn, successor: int | None) -> None:
        turn.successor = None if successor is None else self.turns[successor]

    def wait_turn(self, ubatch_id: int) -> None:
        lock = self.turns[ubatch_id].lock
        if not lock.acquire(True, self.poll_s):
            self.wait_stalled(lock)
        self.check_aborted()
        self._count_first_resume(ubatch_id)

    def finish(self, ubatch_id: int) -> None:
        self.finished[ubatch_id] = True
        self._relink()
        target = self.successor[ubatch_id]
        self.holder = target
        self.switches += 1
        if target is None:
            _release(self._done)
        else:
            self.handed_over_at = perf_counter()
            _release(self.turns[target].lock)

    def wait_done(self) -> None:
        """Block the caller until every ubatch finished or the run stalled."""
        if not self._done.acquire(True, self.poll_s):
            self.wait_stalled(self._done)

    def abort(self, error: BaseException) -> None:
        """Fail the run from outside the turn order and wake every waiter."""
        self.record_failure(self.holder, error)
        for turn in self.turns:
            _release(turn.lock)
        _release(self._done)

    def wait_stalled(self, lock: threading.Lock) -> None:
        """Keep waiting for `lock` after a first poll timed out; abort the run once no
        hand-over happened for `timeout` seconds."""
        seen, since = self.switches, time.monotonic()
        while not lock.acquire(True, self.poll_s):
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


class GreenletTurn(Turn):
    __slots__ = ("switch_to_successor",)

    def __init__(self, handoff: Handoff, ubatch_id: int):
        super().__init__(handoff, ubatch_id)
        #: The successor greenlet's bound `switch`, or None.
        self.switch_to_successor = None

    def pass_(self) -> None:
        handoff, switch = self.handoff, self.switch_to_successor
        if switch is None:
            handoff.check_aborted()
            return
        handoff.switches += 1
        handoff.handed_over_at = perf_counter()
        switch()
        # No abort check: after an abort nobody switches here; the executor throws
        # `UBatchAborted` into this switch instead (`GreenletHandoff.resume`).
        now = perf_counter()
        handoff.switch_time_s += now - handoff.handed_over_at
        if handoff.tracer is not None:
            handoff.tracer.switch(self.id, handoff.handed_over_at, now)


class GreenletHandoff(Handoff):
    """All ubatches on one OS thread: a yield is a direct greenlet switch, nothing blocks.

    The executor `attach`es the greenlets and `resume`s `holder` until it becomes None.
    """

    shares_thread = True

    def __init__(self, num_ubatches: int, timeout: float):
        self.greenlets: list | None = None
        super().__init__(num_ubatches, timeout)

    def _new_turn(self, ubatch_id: int) -> GreenletTurn:
        return GreenletTurn(self, ubatch_id)

    def _link(self, turn: GreenletTurn, successor: int | None) -> None:
        greenlets = self.greenlets
        turn.switch_to_successor = None if successor is None or greenlets is None else greenlets[successor].switch

    def attach(self, greenlets: list) -> None:
        """Give the run its greenlets, one per ubatch in id order."""
        if len(greenlets) != self.num_ubatches:
            raise ValueError(f"got {len(greenlets)} greenlets for {self.num_ubatches} ubatches")
        self.greenlets = list(greenlets)
        self._relink()

    def resume(self, ubatch_id: int) -> None:
        """Run ubatch `ubatch_id` until control comes back to the caller's greenlet (it
        finished); in an aborted run a ubatch parked in a yield gets `UBatchAborted` there."""
        target = self.greenlets[ubatch_id]
        if self.aborted and target:  # `target` is true while it is started and not dead
            target.throw(self.aborted_error())
        else:
            target.switch()

    def wait_turn(self, ubatch_id: int) -> None:
        if self.greenlets is None:
            raise RuntimeError(
                "greenlet ubatch contexts run only under a GreenletExecutor "
                "(run_ubatches(..., executor='greenlet'))"
            )
        self.check_aborted()
        self._count_first_resume(ubatch_id)

    def finish(self, ubatch_id: int) -> None:
        # Returning from the greenlet lands in the executor, which resumes `holder`.
        self.finished[ubatch_id] = True
        self._relink()
        self.holder = self.successor[ubatch_id]
        self.switches += 1
        if self.holder is not None:
            self.handed_over_at = perf_counter()
