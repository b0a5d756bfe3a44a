"""The align step: the one-program Triton kernel (under the interpreter) gives exactly the
torch path's rows and block experts (stable order inside an expert), and the tile table
picks the nearest tuned entry."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tandem.modular_kernels import tile_tables  # noqa: E402
from tandem.modular_kernels.moe_align import (  # noqa: E402
    align_pairs_by_expert,
    align_pairs_by_expert_torch,
    align_pairs_by_expert_triton,
    padded_rows,
)
from tandem.modular_kernels.tile_tables import (  # noqa: E402
    ExpertTiles,
    TileConfig,
    default_tiles,
    expert_tiles,
    table_name,
)


@pytest.mark.parametrize(
    "tokens, top_k, experts, block_m",
    [(5, 2, 4, 4), (37, 6, 64, 16), (3, 1, 3, 16), (150, 8, 160, 16), (64, 6, 64, 64)],
)
def test_triton_align_equals_the_torch_path(tokens, top_k, experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, experts, (tokens, top_k), generator=g)  # -1: another rank's expert
    sorted_ids, block_expert = align_pairs_by_expert_triton(ids, experts, block_m)
    want_ids, want_blocks = align_pairs_by_expert_torch(ids, experts, block_m)
    assert sorted_ids.shape == (padded_rows(ids.numel(), experts, block_m),)
    assert torch.equal(sorted_ids, want_ids)
    assert torch.equal(block_expert.to(torch.int32), want_blocks)


def test_triton_align_rows_are_in_pair_order_per_expert():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [1, 2]])
    sorted_ids, block_expert = align_pairs_by_expert_triton(ids, 3, 4)
    pad = ids.numel()
    assert sorted_ids.tolist() == [1, 4, pad, pad, 6, pad, pad, pad, 0, 2, 5, 7] + [pad] * 8
    assert block_expert.tolist() == [0, 1, 2, -1, -1]


def test_align_takes_the_torch_path_on_cpu():
    ids = torch.tensor([[1, 0]])
    assert [t.dtype for t in align_pairs_by_expert(ids, 2, 4)] == [torch.int64, torch.int32]


def test_tile_table_picks_the_nearest_token_count(tmp_path, monkeypatch):
    monkeypatch.setattr(tile_tables, "device_name", lambda device: "FakeGPU")
    small = ExpertTiles(TileConfig(16, 32, 64, 4, 2), TileConfig(16, 128, 32, 4, 4))
    large = ExpertTiles.both(TileConfig(64, 128, 64, 8, 4))
    tile_tables.write_table(tmp_path / table_name(8, 128, 256, "FakeGPU"), {1: small, 256: large})
    entry = json.loads((tmp_path / table_name(8, 128, 256, "FakeGPU")).read_text())["1"]
    assert entry["gemm1"]["block_n"] == 32 and entry["gemm2"]["block_n"] == 128
    cuda = torch.device("cuda")
    assert expert_tiles(8, 128, 256, 4, 2, cuda, tmp_path) == small
    assert expert_tiles(8, 128, 256, 200, 2, cuda, tmp_path) == large
    assert expert_tiles(8, 64, 256, 4, 2, cuda, tmp_path) == default_tiles(4, 2, 8)  # no table for that shape


def test_the_two_gemms_share_block_m_and_a_one_tile_entry_is_refused(tmp_path, monkeypatch):
    """gpu-review-3 G10: one tile per GEMM; the align step's block size is theirs to share."""
    with pytest.raises(ValueError, match="share block_m"):
        ExpertTiles(TileConfig(block_m=16), TileConfig(block_m=32))
    monkeypatch.setattr(tile_tables, "device_name", lambda device: "FakeGPU")
    (tmp_path / table_name(8, 128, 256, "FakeGPU")).write_text(json.dumps({"1": TileConfig().as_dict()}))
    with pytest.raises(ValueError, match="'gemm1' and a 'gemm2' tile"):
        expert_tiles(8, 128, 256, 4, 2, torch.device("cuda"), tmp_path)


def test_no_table_off_cuda():
    assert expert_tiles(8, 128, 256, 4, 2, torch.device("cpu")) == default_tiles(4, 2, 8)
    assert default_tiles(4, 2, 8).gemm1.block_m == 16 and default_tiles(4096, 8, 8).gemm2.block_m == 64


@pytest.mark.slow  # a subprocess run
def test_tune_script_smoke_writes_a_table(tmp_path):
    """benchmarks/tune_moe_configs.py end to end on the interpreter: a table of GEMM 1 and
    GEMM 2 tiles the loader reads."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    subprocess.run(
        [sys.executable, str(root / "benchmarks/tune_moe_configs.py"), "--smoke", "--out-dir", str(tmp_path),
         "--json", str(tmp_path / "run.json")],
        check=True, env=env, capture_output=True, timeout=240,
    )  # fmt: skip
    table = tile_tables.load_table(tmp_path / table_name(4, 32, 64, "cpu-interpreter"))
    assert set(table) == {1, 4} and all(isinstance(c, ExpertTiles) for c in table.values())
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["best_ms"] <= r["default_ms"] for r in rows)
    # Each GEMM was tuned alone (gpu-review-3 G10), its time beside its default tile's.
    assert all(r[gemm]["ms"] <= r[gemm]["default_ms"] for r in rows for gemm in ("gemm1", "gemm2"))
    assert all(ExpertTiles.from_dict(r["best"]) == table[r["tokens"]] for r in rows)
