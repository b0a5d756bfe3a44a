"""CPU platform: a stream is an ordering token; torch ops run at once, in program order.

What the platform keeps is *which* stream is current (per `contextvars` context, so each
ubatch sees its own), when asked a trace of the protocol calls (tests check the CUDA
handover protocol with it on a machine without a GPU), and the work that test doubles of
GPU libraries defer onto a stream (`enqueue`: e.g. a DeepEP receive launched by its hook).
Deferred work runs only when something is ordered after it, as on a GPU: an event recorded
behind it on its stream is waited, queried or synchronised, or `complete_through` is asked
for it (a read on its own stream). So a double can tell a consumer that reads a buffer on
another stream, with no event between, from one that is correctly ordered.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

from tandem.platform.base import Event, Platform


@dataclass(frozen=True, eq=False)
class CpuStream:
    name: str

    def __repr__(self) -> str:
        return f"CpuStream({self.name!r})"


class CpuEvent(Event):
    def __init__(self, platform: "CpuPlatform", name: str):
        self._platform = platform
        self.name = name
        self.recorded_on: CpuStream | None = None
        #: the last deferred work on `recorded_on` when recorded: what this event completes.
        self._through: int = -1

    def record(self, stream: CpuStream | None = None) -> None:
        stream = stream if stream is not None else self._platform.current_stream()
        self.recorded_on = stream
        self._through = self._platform.last_work_id(stream)
        self._platform._log("record", self.name, stream.name)

    def _complete(self) -> None:
        if self.recorded_on is not None:
            self._platform.complete_through(self.recorded_on, self._through)

    def wait(self, stream: CpuStream | None = None) -> None:
        stream = stream if stream is not None else self._platform.current_stream()
        self._complete()
        self._platform._log("wait", self.name, stream.name)

    def query(self) -> bool:
        self._complete()
        return True

    def synchronize(self) -> None:
        self._complete()

    def __repr__(self) -> str:
        return f"CpuEvent({self.name!r})"


@dataclass
class CpuPlatform(Platform):
    """`trace`, when given, receives `(op, *names)` tuples for every protocol call."""

    trace: list | None = None
    name: str = "cpu"
    default_stream: CpuStream = field(default_factory=lambda: CpuStream("default"))

    def __post_init__(self) -> None:
        self._current = contextvars.ContextVar(f"tandem_cpu_stream_{id(self)}", default=self.default_stream)
        self._ids = itertools.count()
        self._work_ids = itertools.count()
        self._pending: dict[CpuStream, list[tuple[int, Callable[[], None]]]] = {}
        self._last_work: dict[CpuStream, int] = {}
        self._pending_lock = threading.RLock()

    def current_stream(self) -> CpuStream:
        return self._current.get()

    def set_stream(self, stream: CpuStream) -> None:
        self._current.set(stream)
        self._log("set_stream", stream.name)

    def new_stream(self, name: str | None = None) -> CpuStream:
        return CpuStream(name or f"stream{next(self._ids)}")

    def new_event(self, name: str | None = None) -> CpuEvent:
        return CpuEvent(self, name or f"event{next(self._ids)}")

    # -- deferred work (test doubles of GPU libraries) -----------------------------------

    def enqueue(self, work: Callable[[], None], stream: CpuStream | None = None) -> tuple[CpuStream, int]:
        """Defer `work` onto `stream` (default: the current one) behind what is queued there;
        returns `(stream, work id)` for `complete_through`."""
        stream = stream if stream is not None else self.current_stream()
        with self._pending_lock:
            work_id = next(self._work_ids)
            self._pending.setdefault(stream, []).append((work_id, work))
            self._last_work[stream] = work_id
        return stream, work_id

    def last_work_id(self, stream: CpuStream) -> int:
        with self._pending_lock:
            return self._last_work.get(stream, -1)

    def is_complete(self, stream: CpuStream, work_id: int) -> bool:
        with self._pending_lock:
            queue = self._pending.get(stream)
            return not queue or queue[0][0] > work_id

    def complete_through(self, stream: CpuStream, work_id: int) -> None:
        """Run the work deferred on `stream` up to and including `work_id`, in order."""
        while True:
            with self._pending_lock:
                queue = self._pending.get(stream)
                if not queue or queue[0][0] > work_id:
                    return
                _, work = queue.pop(0)
            work()

    def pending_streams(self) -> list[CpuStream]:
        """Streams with deferred work nothing has been ordered after yet (an unjoined fork,
        had it been a CUDA graph capture)."""
        with self._pending_lock:
            return [stream for stream, queue in self._pending.items() if queue]

    def new_graph(self):
        from tandem.platform.cpu_graph import CpuGraph

        return CpuGraph()

    def _log(self, *entry: str) -> None:
        if self.trace is not None:
            self.trace.append(entry)
