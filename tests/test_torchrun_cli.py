"""Every multi-rank command runs under torchrun (one process per rank, env:// rendezvous) as
it runs from one launch: the same tokens from `generate`, the same table structure from
`bench`, and rank 0 alone prints and writes the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.distributed.launch import find_free_port

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()), "-m", "tandem", *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env())


def _local(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=300, env=_env())


def test_generate_under_torchrun_gives_the_local_launchs_tokens():
    args = ["generate", "Hello there", "MoE experts", "--max-tokens", "4", "--json", "--device", "cpu"]
    under = _torchrun(*args)
    assert under.returncode == 0, under.stderr
    local = _local(*args, "--data-parallel-size", "2")
    assert local.returncode == 0, local.stderr
    rows = [json.loads(line) for line in under.stdout.splitlines()]
    assert len(rows) == 2  # rank 0 alone prints
    assert rows == [json.loads(line) for line in local.stdout.splitlines()]
    assert "torchrun world=2" in under.stderr and "dp=2" in under.stderr


def test_bench_under_torchrun_writes_one_table_like_the_local_launch(tmp_path):
    args = ["bench", "--model", "moe-stack", "--tokens", "4", "--modes", "none,dbo", "--repeat", "1", "--warmup", "0"]
    under = _torchrun(*args, "--json", str(tmp_path / "torchrun.json"))
    assert under.returncode == 0, under.stderr
    local = _local(*args, "--json", str(tmp_path / "local.json"))
    assert local.returncode == 0, local.stderr
    assert under.stdout.count("2 ranks") == 1 and under.stdout.splitlines()[0] == local.stdout.splitlines()[0]
    shape = lambda path: [(r["tokens_per_rank"], r["mode"]) for r in json.loads(path.read_text())["rows"]]  # noqa: E731
    assert shape(tmp_path / "torchrun.json") == shape(tmp_path / "local.json")


def test_a_rank_count_other_than_torchruns_is_refused():
    under = _torchrun("generate", "hi", "--max-tokens", "1", "--device", "cpu", "--pipeline-parallel-size", "3")
    assert under.returncode != 0 and "is not a multiple of" in under.stderr
