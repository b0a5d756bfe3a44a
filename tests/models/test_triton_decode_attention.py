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


def test_kv_splits_fill_the_gpu_about_twice_over(monkeypatch):
    """gpu-review-3 G5: 2 x SMs programs, rounded down to a power of 2 in [1, 8], instead of
    a fixed 8 whose float32 partials outweigh the KV at large batches."""
    import torch

    from tandem.models import triton_decode_attention as tda

    monkeypatch.setattr(tda, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    # DeepSeek-V2-Lite's MLA: one KV head of 16 query heads, one head program per request.
    assert [tda.kv_splits_for(r, 1, cuda) for r in (1, 8, 33, 64, 100, 256, 512)] == [8, 8, 8, 4, 2, 1, 1]
    # Qwen3-30B-A3B: 4 KV heads of 8, one program each.
    assert [tda.kv_splits_for(r, 4, cuda) for r in (8, 16, 32, 64)] == [8, 4, 2, 1]
    assert tda.kv_splits_for(512, 1, torch.device("cpu")) == tda.DEFAULT_KV_SPLITS
