"""Triton launches, seen where Triton's Python launcher starts one: `kernel[grid](...)` calls
`JITFunction.run` (`InterpretedFunction.run` under `TRITON_INTERPRET=1`), which no ATen
dispatch mode sees. While at least one listener is open (`listening`), both `run`s are
wrapped to tell every listener the kernel's name before the launch (a `warmup`, which only
compiles, is not a launch); when the last listener closes, the originals are put back.

A stand-in for Triton that launches nothing (the fake-CUDA harness) reports its launches
with `launched(name)`, so whoever listens counts them the same way.

The wrap is process-wide (a class attribute): a listener that wants only its own thread's
launches filters on `threading.get_ident()` itself, as `OpCounter` does. What runs inside a
wrapped launch (the interpreter copies each tensor to the host and back through ATen ops) is
part of the launch: `inside_launch()` says so, for a counter of ATen ops to skip.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from tandem.platform.triton_utils import triton_installed

_listeners: list[Callable[[str], None]] = []
#: (class, its own `run`) for each launcher wrapped now.
_wrapped: list[tuple[type, Callable]] = []
_lock = threading.Lock()
_depth = threading.local()


def launched(name: str) -> None:
    """Tell every open listener that kernel `name` was launched."""
    for listener in tuple(_listeners):
        listener(name)


def inside_launch() -> bool:
    """Whether this thread is inside a wrapped Triton launch now."""
    return getattr(_depth, "n", 0) > 0


def kernel_name(kernel) -> str:
    """A JIT (or interpreted) function's kernel name: its Python function's."""
    return getattr(getattr(kernel, "fn", None), "__name__", None) or type(kernel).__name__


def _launchers() -> list[type]:
    if not triton_installed():
        return []
    from triton.runtime.jit import JITFunction

    found = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every Triton tandem supports has one
        return found
    return found + [InterpretedFunction]


def _counting(run: Callable) -> Callable:
    @functools.wraps(run)
    def run_counted(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            launched(kernel_name(self))
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return run(self, *args, **kwargs)
        finally:
            _depth.n -= 1

    return run_counted


def _wrap() -> None:
    for cls in _launchers():
        own = cls.__dict__["run"]
        _wrapped.append((cls, own))
        cls.run = _counting(own)


def _unwrap() -> None:
    while _wrapped:
        cls, own = _wrapped.pop()
        cls.run = own


def wrapped() -> bool:
    """Whether Triton's launchers are wrapped now (a listener is open)."""
    return bool(_wrapped)


@contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """`listener(kernel name)` is called for each Triton launch while the block runs; the
    launchers are restored when the last listener leaves, also when the block raises."""
    with _lock:
        if not _listeners:
            _wrap()
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
            if not _listeners:
                _unwrap()


__all__ = ["inside_launch", "kernel_name", "launched", "listening", "wrapped"]
