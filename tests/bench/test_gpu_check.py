"""benchmarks/gpu_check.sh's CPU smoke path: the script a GPU session runs first, run here
with its CUDA steps skipped, so it cannot rot between the rare sessions that have a GPU."""

import json
import os
import subprocess
import sys
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
    # The GPU goals at a glance: on the CPU each is "not measured", never met or missed.
    assert len(summary["goals"]) == 5 and {g["verdict"] for g in summary["goals"]} == {"not measured"}
    assert "| goal (issue 30) | figure | verdict |" in result.stdout
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


@pytest.mark.slow  # a subprocess run
def test_the_gpu_goals_read_the_results_as_a_gpu_run_writes_them(tmp_path):
    """The verdicts a GPU run would print, from results shaped as its steps write them (here a
    CPU profile standing in for the GPU's, and made-up engine rates)."""
    import subprocess as sp

    from tandem.testing.gpu_goals import gpu_goals, goals_table

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    sp.run([sys.executable, "-m", "tandem", "profile", "--model", "tiny-moe", "--device", "cpu", "--batch", "2",
            "--prompt-len", "8", "--decode-steps", "1", "--repeat", "1", "--json", str(tmp_path / "p.json")],
           env=env, check=True, capture_output=True, timeout=240)
    profile = json.loads((tmp_path / "p.json").read_text())
    rates = {"output_tok_s": {"eager": 100.0, "graphs": 140.0}, "settings": {"requests": 64}}
    goals = gpu_goals(profile, rates, 300, on_gpu=True)
    verdicts = {g["goal"].split(" (")[0]: (g["figure"], g["verdict"]) for g in goals}
    decode_ratio = profile["phases"]["decode"]["step_over_weight_floor"]
    assert verdicts["decode step <= 2x its weight floor"] == (f"{decode_ratio:.2f}x", "met" if decode_ratio <= 2 else "missed")
    assert verdicts["graphs >= 1.3x eager"] == ("1.40x", "met")
    assert verdicts["the whole check in <= 6 minutes"] == ("300 s", "met")
    assert verdicts["no graph captured while serving after start-up"] == ("-", "not measured")
    assert gpu_goals(profile, {"output_tok_s": {"eager": 100.0, "graphs": 120.0}, "settings": {"requests": 8}}, 400,
                     on_gpu=True)[2:5:2] == [
        {"goal": "graphs >= 1.3x eager (8 requests)", "figure": "1.20x", "verdict": "missed"},
        {"goal": "the whole check in <= 6 minutes", "figure": "400 s", "verdict": "missed"},
    ]
    assert goals_table(goals).splitlines()[0] == "| goal (issue 30) | figure | verdict |"
