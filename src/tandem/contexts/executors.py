"""Executors run the ubatches of one forward strictly one at a time.

`ThreadExecutor` keeps one OS thread per ubatch alive across forwards; `GreenletExecutor`
runs every ubatch on the caller's thread. Both enter each ubatch's `UBatchContext` inside a
copy of the caller's `contextvars` context, so per-ubatch state (current ubatch, forward
context, current stream) is restored by the switch itself.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Any, Callable, Sequence

from tandem.contexts.errors import UBatchAborted, UBatchTimeoutError
from tandem.contexts.trace import begin_traced_run
from tandem.platform.graph import join_graph_capture
from tandem.contexts.ubatch_context import (
    DEFAULT_TIMEOUT_S,
    UBatchContext,
    current_ubatch_context,
    make_ubatch_contexts,
)


def _run_one(ctx: UBatchContext, fn: Callable[[], Any], results: list, index: int) -> None:
    try:
        # Inside a graph capture, this ubatch's ops (on its worker thread) join the capture.
        with join_graph_capture(), ctx:
            results[index] = fn()
    except BaseException:  # noqa: BLE001 - recorded in the run's handoff by ctx.__exit__
        pass


def _annotate(exc: BaseException, note: str) -> BaseException:
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return exc


class UBatchExecutor:
    kind: str
    #: What `run` takes: zero-argument ubatch functions that hand over at `dbo_yield` (threads,
    #: greenlets), or, for the stage executor (`operations.StageExecutor`), operation lists
    #: interleaved stage by stage. Callers branch on this, never on the executor's class.
    runs_operations = False

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S):
        self.timeout = timeout
        self._busy = threading.Lock()
        #: Runs driven and ubatch switches made, over the executor's life.
        self.runs = 0
        self.switches = 0
        #: Hand-over latency of those switches, seconds (see `Handoff.switch_time_s`).
        self.switch_time_s = 0.0

    def run(
        self,
        fns: Sequence[Callable[[], Any]],
        contexts: Sequence[UBatchContext] | None = None,
        *,
        timeout: float | None = None,
    ) -> list:
        """Run `fns[i]` as ubatch i; return their results in ubatch order.

        The first failure is re-raised here (noting its ubatch) once every other ubatch has
        been released; the executor stays usable.
        """
        if not fns:
            return []
        if current_ubatch_context() is not None:
            raise RuntimeError("run_ubatches cannot be nested inside a running ubatch")
        if contexts is None:
            contexts = make_ubatch_contexts(
                len(fns), executor=self.kind, timeout=self.timeout if timeout is None else timeout
            )
        elif len(contexts) != len(fns):
            raise ValueError(f"got {len(contexts)} ubatch contexts for {len(fns)} ubatch functions")
        handoff = contexts[0]._handoff
        if handoff.finished[0] or any(ctx._handoff is not handoff for ctx in contexts):
            raise ValueError("contexts must be one fresh set from a single make_ubatch_contexts call")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"this {type(self).__name__} is already running ubatches for another caller; "
                "use one executor per caller thread"
            )
        handoff.tracer = begin_traced_run()
        try:
            results: list = [None] * len(fns)
            self._drive(contexts, fns, results)
        finally:
            if handoff.tracer is not None:
                handoff.tracer.end()
            self.runs += 1
            self.switches += handoff.switches
            self.switch_time_s += handoff.switch_time_s
            self._busy.release()
        if handoff.error is not None:
            error = handoff.error
            if not isinstance(error, UBatchTimeoutError):
                _annotate(error, f"raised in ubatch {handoff.failed_ubatch} of {len(fns)}")
            raise error
        return results

    def _drive(self, contexts: Sequence[UBatchContext], fns: Sequence[Callable[[], Any]], results: list) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the executor's workers; a closed executor can still run (it restarts them)."""


class _Worker:
    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.retired = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()
            if self.retired:
                return


class ThreadExecutor(UBatchExecutor):
    """One worker thread per ubatch, created on first use and reused by later runs."""

    kind = "thread"

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(timeout)
        self._workers: list[_Worker] = []

    @property
    def worker_threads(self) -> list[threading.Thread]:
        return [w.thread for w in self._workers]

    def _drive(self, contexts, fns, results) -> None:
        handoff = contexts[0]._handoff
        if handoff.shares_thread:
            raise ValueError("ThreadExecutor needs contexts made with executor='thread'")
        while len(self._workers) < len(fns):
            self._workers.append(_Worker(f"tandem-ubatch-{len(self._workers)}"))
        for i, (ctx, fn) in enumerate(zip(contexts, fns)):
            self._workers[i].jobs.put(lambda c=contextvars.copy_context(), a=(ctx, fn, results, i): c.run(_run_one, *a))
        try:
            handoff.wait_done()
        except BaseException as exc:  # e.g. KeyboardInterrupt in the caller
            handoff.abort(exc)
            raise
        finally:
            if handoff.aborted and not all(handoff.finished):
                self._retire(handoff.wait_finished(grace_s=min(handoff.timeout, 5.0)))

    def _retire(self, stuck: list[int]) -> None:
        # A stuck thread cannot be killed; it leaves when (if ever) it returns, and a fresh
        # worker takes its place so the executor stays usable.
        for i in stuck:
            self._workers[i].retired = True
            self._workers[i] = _Worker(f"tandem-ubatch-{i}")

    def close(self) -> None:
        for worker in self._workers:
            worker.jobs.put(None)
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class GreenletExecutor(UBatchExecutor):
    """Every ubatch a greenlet on the caller's thread; a yield is one greenlet switch."""

    kind = "greenlet"

    def _drive(self, contexts, fns, results) -> None:
        import greenlet

        handoff = contexts[0]._handoff
        if not handoff.shares_thread:
            raise ValueError("GreenletExecutor needs contexts made with executor='greenlet'")
        greenlets = []
        for i, (ctx, fn) in enumerate(zip(contexts, fns)):
            g = greenlet.greenlet(lambda a=(ctx, fn, results, i): _run_one(*a))
            g.gr_context = contextvars.copy_context()
            greenlets.append(g)
        handoff.attach(greenlets)
        while handoff.holder is not None:
            handoff.resume(handoff.holder)


_EXECUTOR_TYPES: dict[str, type[UBatchExecutor]] = {"thread": ThreadExecutor, "greenlet": GreenletExecutor}
_per_caller_thread = threading.local()


def make_executor(kind: str, timeout: float = DEFAULT_TIMEOUT_S) -> UBatchExecutor:
    if kind not in _EXECUTOR_TYPES:
        raise ValueError(f"unknown ubatch executor {kind!r}: expected one of {sorted(_EXECUTOR_TYPES)}")
    return _EXECUTOR_TYPES[kind](timeout)


def _caller_executor(kind: str) -> UBatchExecutor:
    # One executor per caller thread: two threads calling run_ubatches never share workers.
    executors = getattr(_per_caller_thread, "executors", None)
    if executors is None:
        executors = _per_caller_thread.executors = {}
    if kind not in executors:
        executors[kind] = make_executor(kind)
    return executors[kind]


def run_ubatches(
    fns: Sequence[Callable[[], Any]],
    *,
    executor: str | UBatchExecutor = "thread",
    contexts: Sequence[UBatchContext] | None = None,
    timeout: float | None = None,
) -> list:
    """Run each zero-argument callable as one ubatch, one at a time, switching at every
    `dbo_yield`; return the results in ubatch order.

    `executor` is `"thread"`, `"greenlet"` or an executor instance; a name uses this caller
    thread's own executor of that kind, kept for later calls.
    """
    runner = _caller_executor(executor) if isinstance(executor, str) else executor
    return runner.run(fns, contexts, timeout=timeout)


__all__ = [
    "GreenletExecutor",
    "ThreadExecutor",
    "UBatchAborted",
    "UBatchExecutor",
    "make_executor",
    "run_ubatches",
]
