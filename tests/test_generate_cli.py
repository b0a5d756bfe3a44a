"""`tandem generate` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

PROMPTS = ["Experts everywhere", "Hi", "Dual batch overlap hides the all-to-all"]


def _generate(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem", "generate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "overlap, executor",
    [(["--enable-dbo"], "thread"), (["--enable-two-batch-overlap"], "stages")],
    ids=["dbo", "two-batch-overlap"],
)
def test_generate_with_overlap_on_two_ranks_matches_single_rank_greedy(overlap, executor):
    common = [*PROMPTS, "--max-tokens", "6", "--ignore-eos", "--temperature", "0", "--json"]
    single = _generate(*common)
    assert single.returncode == 0, single.stderr
    dbo = _generate(
        *common,
        "--data-parallel-size", "2",
        *overlap,
        "--dbo-decode-token-threshold", "0",
        "--dbo-prefill-token-threshold", "0",
    )
    assert dbo.returncode == 0, dbo.stderr
    rows = [json.loads(line) for line in dbo.stdout.splitlines()]
    assert [row["token_ids"] for row in rows] == [json.loads(line)["token_ids"] for line in single.stdout.splitlines()]
    assert [len(row["token_ids"]) for row in rows] == [6, 6, 6]
    assert all(isinstance(row["text"], str) for row in rows)
    # Logs go to stderr and say what ran; stdout holds only the completions.
    assert "dp=2" in dbo.stderr and "dbo=on" in dbo.stderr and f"executor={executor}" in dbo.stderr
    # SBO with the combine sent block by block, inside the DBO ubatches: same tokens.
    sbo = _generate(*common, "--data-parallel-size", "2", "--enable-dbo", "--dbo-decode-token-threshold", "0",
                    "--enable-sbo", "--sbo-mode", "combine-down-gemm")
    assert sbo.returncode == 0, sbo.stderr
    assert [json.loads(line)["token_ids"] for line in sbo.stdout.splitlines()] == [row["token_ids"] for row in rows]
    assert "sbo=combine-down-gemm" in sbo.stderr


def test_generate_rejects_an_unknown_sbo_mode():
    result = _generate("hello", "--enable-sbo", "--sbo-mode", "turbo", timeout=60)
    assert result.returncode != 0
    assert "--sbo-mode must be one of auto, combine-down-gemm" in result.stderr and "Traceback" not in result.stderr


def test_two_batch_overlap_contradicting_an_executor_is_refused():
    result = _generate("hi", "--enable-two-batch-overlap", "--ubatch-executor", "greenlet", timeout=60)
    assert result.returncode != 0 and "--enable-two-batch-overlap" in result.stderr


def test_generate_prints_one_line_per_prompt_in_order():
    result = _generate(*PROMPTS, "--max-tokens", "4", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == len(PROMPTS) + 1 and lines[-1] == ""


def test_generate_rejects_a_missing_model_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    result = _generate("hello", "--model", str(missing), timeout=60)
    assert result.returncode != 0
    assert str(missing) in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_deepep_flags_are_checked_before_any_rank_starts():
    """--deepep-ll-max-tokens-per-rank is checked against DeepEP's own limits and
    --graph-mode full refuses deepep_high_throughput: one clear error each, no traceback."""
    too_big = _generate(
        "hi", "--data-parallel-size", "2", "--all2all-backend", "deepep_low_latency",
        "--deepep-ll-max-tokens-per-rank", "2048", timeout=60,
    )
    assert too_big.returncode != 0 and "NVSHMEM_QP_DEPTH" in too_big.stderr and "Traceback" not in too_big.stderr
    full = _generate(
        "hi", "--data-parallel-size", "2", "--all2all-backend", "deepep_high_throughput", "--graph-mode", "full",
        "--comm-sms", "24", timeout=60,
    )
    assert full.returncode != 0 and "deepep_high_throughput" in full.stderr and "Traceback" not in full.stderr
