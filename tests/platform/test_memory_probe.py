"""The opt-in memory probe (`TANDEM_MEMORY_PROBE`) a soak uses to split a process's growth."""

from __future__ import annotations

import json
import mmap
import time

from tandem.platform.memory_probe import MemoryProbe, sample, start_from_env


def test_a_sample_splits_resident_memory_and_sees_an_allocation():
    size = 64 << 20
    before = sample()
    # A fresh private anonymous mapping, every page touched: 64 MB that cannot come from pages the
    # process already holds (1 MB bytearrays can: after earlier tests free large blocks, glibc
    # serves them from its heap's resident free pages, and one CI run saw 45 MB of 64 arrive).
    held = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared pages count as shmem
    for offset in range(0, size, mmap.PAGESIZE):
        held[offset] = 1
    after = sample()
    assert after["rss_anon_mb"] - before["rss_anon_mb"] >= 48, (before, after)
    assert abs(after["rss_mb"] - after["rss_anon_mb"] - after["rss_file_mb"]) < 0.05 * after["rss_mb"]
    assert after["python_blocks"] >= before["python_blocks"]
    held.close()


def test_the_probe_writes_samples_and_names_the_line_that_grew(tmp_path):
    probe = MemoryProbe(tmp_path, "test", every_s=0.05, trace=True, baseline_s=0).start()
    try:
        time.sleep(0.2)  # the baseline snapshot
        grown = [bytes(4096) + bytes([i % 256]) for i in range(4000)]  # ~16 MB from this line
        deadline = time.monotonic() + 20
        growth_file = next(tmp_path.glob("*-growth.txt"), None)
        while (growth_file is None or "test_memory_probe.py" not in growth_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
            growth_file = next(tmp_path.glob("*-growth.txt"), None)
    finally:
        probe.stop()
    rows = [json.loads(line) for line in probe.path.read_text().splitlines()]
    assert len(rows) >= 3 and all(row["rss_mb"] > 0 for row in rows)
    assert "traced_mb" in rows[-1] and rows[-1]["traced_mb"] - rows[0]["traced_mb"] > 10
    first_entry = growth_file.read_text().splitlines()[2]
    assert "test_memory_probe.py" in first_entry, growth_file.read_text()[:2000]
    del grown


def test_off_unless_the_environment_names_a_directory(monkeypatch):
    monkeypatch.delenv("TANDEM_MEMORY_PROBE", raising=False)
    assert start_from_env("rank0") is None
