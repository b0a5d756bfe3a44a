"""`--trace` and `bench --timeline` end to end: a 2-rank DBO bench run writes a valid
Chrome trace (both ranks, both ubatches, transfers) and a PNG; `generate --trace` too."""

import json
from collections import defaultdict

import pytest

from tandem.contexts.trace import STEP_TID, TRANSFER_TID, UBATCH_TID
from tests.support.cli import PNG_MAGIC, run_cli

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow


def check_trace_event_format(trace: dict) -> dict:
    """Valid trace-event JSON; returns the spans by (pid, tid), each track in time order
    and never overlapping."""
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["dur"] >= 0
            tracks[(e["pid"], e["tid"])].append(e)
    for spans in tracks.values():
        for a, b in zip(spans, spans[1:]):
            assert a["ts"] <= b["ts"]
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-2, (a, b)
    named = {e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert named == {pid for pid, _ in tracks}
    return tracks


def test_bench_trace_and_timeline_of_a_two_rank_dbo_run(tmp_path):
    trace_path, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    result = run_cli(
        "bench", "--tokens", "8", "--modes", "none,dbo", "--repeat", "1", "--warmup", "0",
        "--fabric-latency-us", "300", "--trace", str(trace_path), "--timeline", str(png),
    )
    assert result.returncode == 0, result.stderr
    tracks = check_trace_event_format(json.loads(trace_path.read_text()))
    assert {pid for pid, _ in tracks} == {0, 1}
    for rank in (0, 1):
        steps = tracks[(rank, STEP_TID)]
        # the modes in sweep order (a model step's floor reuses the "none" step)
        assert [s["args"]["mode"] for s in steps] == ["none", "dbo"]
        assert all(s["args"]["tokens"] == 8 for s in steps)
        for ubatch in (0, 1):
            names = {e["name"] for e in tracks[(rank, UBATCH_TID + ubatch)]}
            assert {"compute", "switch"} <= names
        transfers = [e for (pid, tid), spans in tracks.items() if pid == rank and tid >= TRANSFER_TID for e in spans]
        assert {e["args"]["ubatch"] for e in transfers} == {0, 1}
        # the DBO step's spans lie inside it
        dbo = steps[1]
        inside = [e for e in tracks[(rank, UBATCH_TID + 1)] if e["ts"] < dbo["ts"] + dbo["dur"]]
        assert inside and all(e["ts"] >= dbo["ts"] - 1e-2 for e in inside)
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_generate_trace_with_two_ranks(tmp_path):
    trace_path = tmp_path / "gen.json"
    result = run_cli(
        "generate", "one two three four", "five six seven eight", "--max-tokens", "2", "--data-parallel-size", "2",
        "--enable-dbo", "--dbo-prefill-token-threshold", "4", "--trace", str(trace_path),
    )
    assert result.returncode == 0, result.stderr
    tracks = check_trace_event_format(json.loads(trace_path.read_text()))
    for rank in (0, 1):
        assert len(tracks[(rank, STEP_TID)]) >= 2  # prefill + decode
        assert (rank, UBATCH_TID + 1) in tracks  # the prefill step ran as two ubatches
