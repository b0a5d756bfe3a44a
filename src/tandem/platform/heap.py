"""Giving freed heap back to the OS while a process waits for work.

glibc keeps memory a program frees in its arenas for reuse and returns only the top of each
heap. A serving rank frees different sizes every wave (request state, grammars, tensors of
each batch shape), so the holes between live blocks add up: in the soak a rank's malloc-held
memory stayed flat after the warm-up while its freed-but-kept memory grew by 2-4 MB in six
minutes (`tandem.platform.memory_probe`). `malloc_trim(0)` returns the free pages of every
arena; it takes well under a millisecond and runs only when the process is idle, at most once
per interval."""

from __future__ import annotations

import ctypes
import ctypes.util
import time


class HeapTrimmer:
    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self._last = time.monotonic()
        self.trims = 0
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            self._trim = None

    def idle(self) -> None:
        """The process has no work now: trim, if the last trim is `every_s` old."""
        now = time.monotonic()
        if self._trim is None or now - self._last < self.every_s:
            return
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1


__all__ = ["HeapTrimmer"]
