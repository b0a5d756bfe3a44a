"""CPU platform: a stream is an ordering token and every event completes at once.

CPU ops run synchronously in program order, so there is nothing to wait for; what the
platform keeps is *which* stream is current (per `contextvars` context, so each ubatch
sees its own) and, when asked, a trace of the protocol calls, which lets tests check the
CUDA handover protocol on a machine without a GPU.
"""

from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass, field

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

    def record(self, stream: CpuStream | None = None) -> None:
        stream = stream if stream is not None else self._platform.current_stream()
        self.recorded_on = stream
        self._platform._log("record", self.name, stream.name)

    def wait(self, stream: CpuStream | None = None) -> None:
        stream = stream if stream is not None else self._platform.current_stream()
        self._platform._log("wait", self.name, stream.name)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

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

    def current_stream(self) -> CpuStream:
        return self._current.get()

    def set_stream(self, stream: CpuStream) -> None:
        self._current.set(stream)
        self._log("set_stream", stream.name)

    def new_stream(self, name: str | None = None) -> CpuStream:
        return CpuStream(name or f"stream{next(self._ids)}")

    def new_event(self, name: str | None = None) -> CpuEvent:
        return CpuEvent(self, name or f"event{next(self._ids)}")

    def new_graph(self):
        from tandem.platform.cpu_graph import CpuGraph

        return CpuGraph()

    def _log(self, *entry: str) -> None:
        if self.trace is not None:
            self.trace.append(entry)
