"""The Triton split-KV decode attention on CPU: `triton_decode_cases.py` run under the
Triton interpreter in a subprocess (its sm_90 compile is in `tests/platform/test_triton_sm90.py`).
The interpreter has to be on when triton is imported (its library functions, `tl.max` and
`tl.cdiv` among them, take their mode then), and it must not leak into this process, where
compiled kernels may run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).with_name("triton_decode_cases.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("selection", ["gqa", "mla", "not gqa and not mla"])
def test_interpreted_kernel_cases(selection):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection, str(CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=580,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
