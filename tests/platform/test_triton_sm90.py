"""Every Triton launch tandem makes on a GPU compiles for sm_90 (H100 / H200) within its
shared memory, under the newest Triton (this venv's) and under the GPU image's Triton 3.6
(`build/triton36`, see README "Run the tests"): `tandem.testing.triton_aot` over the manifest
the fake-CUDA job keeps current (`tests/fakecuda/triton_launches.json`). No GPU is needed:
Triton's wheel ships ptxas. Registers and spills are printed, not asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not importorskip: importing triton here would fix the interpreter mode (off) for the test
# modules that set TRITON_INTERPRET=1 at import, if this one were collected first.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

from tandem.testing.triton_aot import SM90_SHARED_LIMIT, _integer_class, label  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "tests" / "fakecuda" / "triton_launches.json"
TRITON_36 = ROOT / "build" / "triton36"
INSTALL_36 = "pip install --target build/triton36 --no-deps triton==3.6.0"


def _compile(manifest: Path, triton_dir: Path | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(triton_dir) if triton_dir else None, str(ROOT / "src"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return subprocess.run(
        [sys.executable, "-m", "tandem.testing.triton_aot", str(manifest)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=580,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("triton", ["newest", "3.6"])
def test_every_launch_compiles_for_sm90(triton):
    triton_dir = None
    if triton == "3.6":
        assert (TRITON_36 / "triton").is_dir(), f"Triton 3.6 (the GPU image's) is not installed here: {INSTALL_36}"
        triton_dir = TRITON_36
    run = _compile(MANIFEST, triton_dir)
    assert run.returncode == 0, run.stderr[-6000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    if triton == "3.6":
        assert report["triton"].startswith("3.6."), report["triton"]
    launches = json.loads(MANIFEST.read_text())["launches"]
    assert set(report["results"]) == {label(entry) for entry in launches}
    for name, usage in report["results"].items():
        print(f"triton {report['triton']}: {name}: {usage}")
        assert usage["shared_bytes"] <= SM90_SHARED_LIMIT, (name, usage)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tile_over_the_shared_memory_fails_by_name(tmp_path):
    """The gate catches what a GPU would refuse: the grouped GEMM at 256x256x128 with 4
    stages needs far more than an sm_90 block's 227 KiB."""
    launches = json.loads(MANIFEST.read_text())["launches"]
    gemm = next(e for e in launches if e["kernel"].endswith("grouped_gemm_kernel") and e["kwargs"]["GATED"])
    too_big = {**gemm, "kwargs": {**gemm["kwargs"], "BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 4}}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"launches": [too_big]}))
    run = _compile(manifest, None)
    assert run.returncode == 1
    assert label(too_big) in run.stderr
    assert "shared memory" in run.stderr or "OutOfResources" in run.stderr


def test_integers_are_described_by_the_class_triton_specialises_on():
    assert _integer_class(1) == 1
    assert _integer_class(2048) == _integer_class(16) == 16
    assert _integer_class(1408 + 3) == 3
    assert _integer_class(1 << 33) % 16 == 0 and _integer_class(1 << 33) >= 1 << 32
    assert _integer_class((1 << 33) + 5) % 16 != 0 and _integer_class((1 << 33) + 5) >= 1 << 32
