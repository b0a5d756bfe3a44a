"""Smoke test of `benchmarks/real_links.py`: its worker path on 2 namespace hosts over a
shaped link, one mode pair at one rate, tiny shapes; skipped where namespaces can't be made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _namespaces() -> tuple[bool, str]:
    from tandem.testing.netns_cluster import namespaces_available

    return namespaces_available()


def test_real_links_runs_on_shaped_namespace_hosts_and_dbo_changes_no_output(tmp_path):
    ok, reason = _namespaces()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {reason}")
    plan = {
        "jobs": [{"workload": "moe-stack", "phase": "prefill", "tokens": 32, "shape": {"hidden": 128, "intermediate": 64, "layers": 2}}],
        "modes": ["none", "dbo"], "ratios": [1.0], "warmup": 0, "repeat": 1, "compute_repeat": 1,
        "probe_mbit": 50.0, "under_transfer_mbit": 50.0, "context_len": 64, "threads": 1, "one_host": False,
    }
    out = tmp_path / "real_links.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "real_links.py"), "--plan-json", json.dumps(plan), "--out", str(out), "--timeout", "240"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    (job,) = data["jobs"]
    assert (job["workload"], job["phase"], job["tokens"]) == ("moe-stack", "prefill", 32)
    (row,) = job["rows"]
    assert row["rate_mbit"] > 0 and row["compute_s"] > 0 and row["floor_s"] == max(row["compute_s"], row["comm_s"])
    assert set(row["step_s"]) == {"none", "dbo"} and set(row["vs_none"]) == {"none", "dbo"}
    assert row["vs_none"]["none"] == 1.0 and all(v > 0 for v in row["step_s"].values())
    # The rate the driver set on the link is the row's rate (then the link is unshaped again).
    assert row["rate_mbit"] in data["link"]["rates_set_mbit"] and data["link"]["rates_set_mbit"][-1] is None
    # Compute under a transfer is measured once, first, at the plan's rate, and kept with each job;
    # the job also timed its compute-only step, which the unshaped none step's transfers add to.
    under = job["compute_under_transfer"]
    assert data["link"]["rates_set_mbit"][0] == under["rate_mbit"] == 50.0 and 0 < under["wire_rate"] <= 1
    assert 0 < job["compute_alone_s"] < job["unshaped_none_s"] + 1.0
    # DBO over the real link gives exactly the unsplit outputs.
    assert job["outputs"]["max_abs_diff"] < 1e-5 and job["outputs"]["none_sum"] == pytest.approx(job["outputs"]["dbo_sum"], rel=1e-5)
    assert "moe-stack prefill" in result.stdout and "goals:" in result.stdout
    made = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tdr" not in made
