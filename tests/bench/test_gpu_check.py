"""benchmarks/gpu_check.sh's CPU smoke path: the script a GPU session runs first, run here
with its CUDA steps skipped, so it cannot rot between the rare sessions that have a GPU."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess run
def test_gpu_check_cpu_path_runs_every_step_it_can(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert status == {"wheels": "skipped", "cuda_tests": "skipped", "cuda_vs_cpu_tokens": "skipped",
                      "profile": "ok", "engine_tok_s": "ok", "gpu_sweep": "skipped"}
    assert summary["cpu_smoke"] is True
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["phases"]["decode"]["tokens"] == 2 and profile["phases"]["decode"]["weight_floor_ms"] > 0
    rates = json.loads((tmp_path / "engine_tok_s.json").read_text())["output_tok_s"]
    assert set(rates) == {"eager", "dbo"} and min(rates.values()) > 0
    log = (tmp_path / "gpu_check.log").read_text()
    assert "cuda_tests: skipped (no GPU)" in log and "| attention |" in log.replace("    ", "")
    # At most 8 files: what the device tool brings back from $OUT.
    assert len(list(tmp_path.iterdir())) <= 8


def test_gpu_path_step_limits_add_up_to_the_budget_of_one_call():
    """gpu-review-3 G14: the limits once summed to 520 s against a 460 s budget, so the last
    steps were cut short. The GPU path's limits must fit the default budget, and the budget
    must leave the 8-minute call room for the machine's start and the transfers."""
    import re

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    budget = int(re.search(r"BUDGET=\$\{TANDEM_GPU_CHECK_BUDGET_S:-(\d+)\}", script)[1])
    gpu_path = script[script.index("\nelse\n"): script.index("\nfi\n")]
    limits = {name: int(limit) for name, limit in re.findall(r"^\s*step (\w+) (\d+) ", gpu_path, re.M)}
    assert set(limits) == {"wheels", "cuda_tests", "cuda_vs_cpu_tokens", "profile", "engine_tok_s", "gpu_sweep"}
    assert sum(limits.values()) <= budget <= 6 * 60, (limits, budget)
