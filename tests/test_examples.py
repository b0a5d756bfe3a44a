"""The examples run as users run them: a subprocess, with a bounded timeout."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_embed_in_your_runner_matches_the_original_model(tmp_path):
    trace = tmp_path / "timeline.json"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "embed_in_your_runner.py"), "--trace", str(trace)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "result: match" in result.stdout
    for rank in (0, 1):
        assert f"rank {rank}:" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X" and e["name"] == "switch"} == {0, 1}
