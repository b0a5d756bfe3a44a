"""What every platform graph shares: the `Graph` contract, the capture error, and the
per-context "a capture is running" state that ubatch workers join.

A graph is captured once from a callable that reads *static input buffers* (tensors the
caller keeps and refills before each replay) and returns its outputs; `replay()` re-runs
the recorded work on whatever the static inputs hold now and returns the same output
tensors, overwritten. No Python of the captured callable runs during a replay.

The capture state lives in a `ContextVar`, so it follows the code that runs inside the
capture into the DBO ubatch workers: the executors copy the caller's context into each
ubatch (thread or greenlet) and call `join_graph_capture()` around it, which lets a CPU
capture record that thread's ops too (see `tandem.platform.cpu_graph`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from contextvars import ContextVar
from typing import Any, Callable, Iterator


class GraphCaptureError(RuntimeError):
    """The captured callable did something a graph cannot hold (a host sync, a
    data-dependent shape, an unrecordable collective); the message names the op."""

    def __init__(self, message: str, op: str | None = None):
        super().__init__(message)
        self.op = op


class _CaptureState:
    """What `_ACTIVE_CAPTURE` holds while a graph is being captured."""

    kind: str = "graph"

    def join_thread(self) -> contextlib.AbstractContextManager:
        """Make ops of the calling thread part of the capture (a no-op unless the
        platform records per thread)."""
        return contextlib.nullcontext()


_ACTIVE_CAPTURE: ContextVar[_CaptureState | None] = ContextVar("tandem_active_graph_capture", default=None)


def graph_capture_active() -> bool:
    """True inside a graph capture: in the capturing code and in every ubatch it runs."""
    if _ACTIVE_CAPTURE.get() is not None:
        return True
    try:
        import torch

        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - no CUDA build / driver: nothing is capturing
        return False


@contextlib.contextmanager
def _capturing(state: _CaptureState) -> Iterator[None]:
    token = _ACTIVE_CAPTURE.set(state)
    try:
        yield
    finally:
        _ACTIVE_CAPTURE.reset(token)


def join_graph_capture() -> contextlib.AbstractContextManager:
    """Called by the ubatch executors around each ubatch: if the code that started the
    run is capturing a graph, the ubatch's own ops join that capture."""
    state = _ACTIVE_CAPTURE.get()
    return contextlib.nullcontext() if state is None else state.join_thread()


class Graph(ABC):
    """A captured piece of device work, replayable on new contents of its static inputs."""

    #: True when `capture` itself computes valid outputs (the CPU graph runs the callable
    #: while it records); False when only `replay` does (CUDA capture launches nothing).
    capture_computes_outputs: bool = False

    @abstractmethod
    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Capture `fn(*args, **kwargs)` once; return its outputs, which are the graph's
        static outputs (valid after capture only if `capture_computes_outputs`)."""

    @abstractmethod
    def replay(self) -> Any:
        """Re-run the captured work on the static inputs' current contents; return the
        static outputs, overwritten in place."""

    @property
    @abstractmethod
    def captured(self) -> bool: ...

    @property
    @abstractmethod
    def outputs(self) -> Any:
        """The static outputs (same tensors after every replay)."""

    def reset(self) -> None:
        """Drop the capture and everything it holds."""
