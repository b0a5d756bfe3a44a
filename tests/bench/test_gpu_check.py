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
