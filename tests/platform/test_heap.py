"""An idle rank hands freed heap back to the OS (`HeapTrimmer`), at most once per interval."""

from __future__ import annotations

import pytest

from tandem.platform.heap import HeapTrimmer
from tandem.platform.memory_probe import sample


def _holes() -> list[bytearray]:
    """~24 MB of 64 KB blocks (below glibc's mmap threshold, so inside an arena), nine in ten
    freed: the survivors pin the heap, so glibc's own trim of its top cannot return the holes."""
    blocks = [bytearray(64 << 10) for _ in range(384)]
    return blocks[::10]


def test_trimming_returns_the_free_holes_between_live_blocks():
    trimmer = HeapTrimmer(every_s=0)
    if trimmer._trim is None:
        pytest.skip("not glibc")
    kept = _holes()
    before = sample()
    trimmer.idle()
    after = sample()
    assert trimmer.trims == 1
    assert before["rss_anon_mb"] - after["rss_anon_mb"] > 12, (before, after)
    del kept


def test_at_most_once_per_interval():
    trimmer = HeapTrimmer(every_s=3600)
    kept = _holes()
    before = sample()
    trimmer.idle()
    assert trimmer.trims == 0 and sample()["rss_anon_mb"] > before["rss_anon_mb"] - 2
    del kept
