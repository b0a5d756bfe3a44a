"""Where a process's memory goes, sampled from inside it while it serves: an opt-in probe
for leak hunts (`benchmarks/soak.py --memory-probe`), off unless `TANDEM_MEMORY_PROBE` names
a directory.

Resident memory alone cannot tell a leak from an allocator that keeps what it freed. Every
`TANDEM_MEMORY_PROBE_S` seconds (5) a daemon thread appends one JSON line to
`<dir>/<name>-<pid>.jsonl` that splits it:

- `rss_anon_mb` / `rss_file_mb`: anonymous (heap, arenas, tensors) vs mapped files (libraries);
- `malloc_in_use_mb` / `malloc_free_mb` / `malloc_mmap_mb`: glibc's own count (`mallinfo2`)
  of what the program holds, what the arenas keep freed but unreturned, and large blocks
  mapped on their own;
- `python_blocks`: objects and buffers Python's allocator holds (`sys.getallocatedblocks`);
- with `TANDEM_MEMORY_PROBE_TRACE=1`, `traced_mb` from `tracemalloc` (slow: debugging only),
  and `<name>-<pid>-growth.txt`, rewritten on every sample after the baseline
  (`TANDEM_MEMORY_PROBE_BASELINE_S`, 60 s): the 25 call stacks (4 frames, newest first) whose
  live allocations grew most since then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
import threading
import time
from pathlib import Path

_MB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2 (2.33+), or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    return fn


def malloc_in_use_bytes() -> int:
    """What the program holds from glibc's malloc now (arenas and mapped blocks), or -1."""
    mallinfo = _mallinfo2()
    if mallinfo is None:
        return -1
    info = mallinfo()
    return info.uordblks + info.hblkhd


def _status_kb(fields: tuple[str, ...]) -> dict[str, int]:
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in fields:
                found[key] = int(rest.split()[0])
    return found


def sample(mallinfo=None) -> dict:
    """One reading of this process's memory (the fields the module docstring names)."""
    kb = _status_kb(("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"))
    row = {
        "t": time.time(),
        "rss_mb": kb.get("VmRSS", 0) / 1024,
        "rss_anon_mb": kb.get("RssAnon", 0) / 1024,
        "rss_file_mb": (kb.get("RssFile", 0) + kb.get("RssShmem", 0)) / 1024,
        "threads": kb.get("Threads", 0),
        "python_blocks": sys.getallocatedblocks(),
    }
    if mallinfo is not None:
        info = mallinfo()
        row.update(malloc_in_use_mb=info.uordblks / _MB, malloc_free_mb=info.fordblks / _MB,
                   malloc_mmap_mb=info.hblkhd / _MB, malloc_arena_mb=info.arena / _MB)
    import tracemalloc

    if tracemalloc.is_tracing():
        row["traced_mb"] = tracemalloc.get_traced_memory()[0] / _MB
    return row


class MemoryProbe:
    def __init__(self, directory: Path, name: str, every_s: float, trace: bool, baseline_s: float):
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"{name}-{os.getpid()}"
        self.path, self.growth_path = directory / f"{stem}.jsonl", directory / f"{stem}-growth.txt"
        self.every_s, self.trace, self.baseline_s = every_s, trace, baseline_s
        self.mallinfo = _mallinfo2()
        self.started = time.monotonic()
        self.baseline = None
        self._stopped = threading.Event()
        if trace:
            import tracemalloc

            tracemalloc.start(4)

    def start(self) -> "MemoryProbe":
        self._thread = threading.Thread(target=self._run, name="tandem-memory-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Take one last sample and stop (a process may also just exit: the thread is a daemon)."""
        self._stopped.set()
        self._thread.join(timeout=30)
        if self.trace:
            import tracemalloc

            tracemalloc.stop()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._record()
            self._stopped.wait(self.every_s)
        self._record()

    def _record(self) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(sample(self.mallinfo)) + "\n")
        if self.trace:
            self._trace_growth()

    def _trace_growth(self) -> None:
        import tracemalloc

        if time.monotonic() - self.started < self.baseline_s:
            return
        snapshot = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        if self.baseline is None:
            self.baseline = snapshot
            return
        lines = [f"growth since the baseline ({self.baseline_s:g} s after start), by where it was allocated:"]
        for stat in snapshot.compare_to(self.baseline, "traceback")[:25]:
            lines.append(f"{stat.size_diff / 1024:+.1f} KiB in {stat.count_diff:+d} blocks, from:")
            lines += ["  " + line for line in stat.traceback.format(most_recent_first=True)]
        self.growth_path.write_text("\n".join(lines) + "\n")


def start_from_env(name: str) -> MemoryProbe | None:
    """Start the probe if `TANDEM_MEMORY_PROBE` names a directory; `name` says which process."""
    directory = os.environ.get("TANDEM_MEMORY_PROBE")
    if not directory:
        return None
    return MemoryProbe(
        Path(directory), name, every_s=float(os.environ.get("TANDEM_MEMORY_PROBE_S", "5")),
        trace=os.environ.get("TANDEM_MEMORY_PROBE_TRACE") == "1",
        baseline_s=float(os.environ.get("TANDEM_MEMORY_PROBE_BASELINE_S", "60")),
    ).start()


__all__ = ["MemoryProbe", "malloc_in_use_bytes", "sample", "start_from_env"]
