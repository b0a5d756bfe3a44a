"""The stream/event interface that the ubatch runtime programs against.

`contexts` never touches `torch.cuda` directly: it asks a `Platform` for streams and
events, so the same handover protocol runs on CUDA and, as cheap ordering tokens, on CPU.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.platform.graph import Graph


class Event(ABC):
    """A marker recorded on a stream that other streams (or the host) can wait for."""

    @abstractmethod
    def record(self, stream: Any = None) -> None:
        """Record on `stream` (default: the current stream)."""

    @abstractmethod
    def wait(self, stream: Any = None) -> None:
        """Make `stream` (default: the current stream) wait until this event completes."""

    @abstractmethod
    def query(self) -> bool:
        """True once the work recorded before this event has completed."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event completes."""


class Platform(ABC):
    """Streams and events of one device type."""

    name: str
    #: True when the current stream is per OS thread rather than per `contextvars`
    #: context, so a ubatch resumed on a shared thread (greenlets) must re-apply it.
    stream_is_thread_state: bool = False

    @abstractmethod
    def current_stream(self) -> Any: ...

    @abstractmethod
    def set_stream(self, stream: Any) -> None: ...

    @abstractmethod
    def new_stream(self) -> Any: ...

    @abstractmethod
    def new_event(self) -> Event: ...

    def use_device(self, device: Any) -> contextlib.AbstractContextManager:
        """Make `device` the calling thread's current device (its current stream, events and
        graphs are then that device's); a no-op on CPU."""
        return contextlib.nullcontext()

    def prepare_stream_for_capture(self, stream: Any) -> None:
        """Create, outside any capture, the per-thread per-stream library state that the
        first kernel on `stream` would otherwise create inside one (a no-op on CPU)."""

    @abstractmethod
    def new_graph(self) -> "Graph":
        """An empty `Graph` (see `tandem.platform.graph`) for this device; graphs made by one
        platform share a memory pool where the device has one."""
