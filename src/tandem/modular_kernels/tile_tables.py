"""Tile configurations of the Triton grouped GEMMs, chosen per (experts, N, K, tokens,
device) from small tables, as vLLM's fused-MoE config tables are.

The experts run two GEMMs whose shapes differ: GEMM 1 (gate/up, `[pairs, H] x [2I, H]`, N = I,
K = H) and GEMM 2 (down, `[pairs, I] x [H, I]`, N = H, K = I), so each has its own tile
(`ExpertTiles`); only `block_m` is shared, since the align step pads each expert's rows to one
block size that both GEMMs walk.

A table is one JSON file per shape and device, `E={E},N={N},K={K},device={name}.json` in
`tile_tables/` (N is the expert intermediate size, K the hidden size), mapping a token count
to `{"gemm1": tile, "gemm2": tile}`, each tile `{"block_m", "block_n", "block_k",
"num_warps", "num_stages"}`; a call takes the entry of the nearest token count.
`benchmarks/tune_moe_configs.py` measures and writes them. Without a table (or off CUDA) a
default by token count applies to both GEMMs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).with_name("tile_tables")


@dataclass(frozen=True)
class TileConfig:
    """One GEMM's tile and launch options."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExpertTiles:
    """GEMM 1's (gate/up) and GEMM 2's (down) tiles; `block_m` is one for both."""

    gemm1: TileConfig
    gemm2: TileConfig

    def __post_init__(self) -> None:
        if self.gemm1.block_m != self.gemm2.block_m:
            raise ValueError(
                f"GEMM 1 and GEMM 2 share block_m (the align step pads to one), got {self.gemm1.block_m} "
                f"and {self.gemm2.block_m}"
            )

    @classmethod
    def both(cls, tile: TileConfig) -> ExpertTiles:
        return cls(tile, tile)

    @classmethod
    def from_dict(cls, entry: dict) -> ExpertTiles:
        if set(entry) != {"gemm1", "gemm2"}:
            raise ValueError(
                f"a tile-table entry holds a 'gemm1' and a 'gemm2' tile, got keys {sorted(entry)}: "
                "re-run benchmarks/tune_moe_configs.py"
            )
        return cls(TileConfig(**entry["gemm1"]), TileConfig(**entry["gemm2"]))

    def as_dict(self) -> dict:
        return {"gemm1": self.gemm1.as_dict(), "gemm2": self.gemm2.as_dict()}


def table_name(num_experts: int, n: int, k: int, device_name: str) -> str:
    return f"E={num_experts},N={n},K={k},device={device_name}.json"


@lru_cache(maxsize=None)
def device_name(device: torch.device) -> str | None:
    """The CUDA device's name as table files spell it (None off CUDA or without a driver)."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.get_device_name(device).replace(" ", "_")
    except (RuntimeError, AssertionError):
        return None


def default_tile(num_tokens: int, top_k: int, num_experts: int) -> TileConfig:
    """Few rows per expert (decode): short M blocks so padding stays small; many: wider."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return TileConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return TileConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def default_tiles(num_tokens: int, top_k: int, num_experts: int) -> ExpertTiles:
    return ExpertTiles.both(default_tile(num_tokens, top_k, num_experts))


@lru_cache(maxsize=None)
def load_table(path: Path) -> dict[int, ExpertTiles] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return {int(tokens): ExpertTiles.from_dict(entry) for tokens, entry in raw.items()}


def write_table(path: Path, table: dict[int, ExpertTiles]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({str(t): tiles.as_dict() for t, tiles in sorted(table.items())}, f, indent=1)
        f.write("\n")
    load_table.cache_clear()


def expert_tiles(
    num_experts: int, n: int, k: int, num_tokens: int, top_k: int, device: torch.device, table_dir: Path = TABLE_DIR
) -> ExpertTiles:
    """The tuned entry of the nearest token count for this shape and device, else the default."""
    name = device_name(device)
    table = load_table(table_dir / table_name(num_experts, n, k, name)) if name else None
    if not table:
        return default_tiles(num_tokens, top_k, num_experts)
    return table[min(table, key=lambda tokens: (abs(tokens - num_tokens), tokens))]


__all__ = [
    "TABLE_DIR", "ExpertTiles", "TileConfig", "default_tile", "default_tiles", "device_name", "expert_tiles",
    "load_table", "table_name", "write_table",
]  # fmt: skip
