"""Tune the Triton experts' two grouped GEMMs for one MoE shape, per token count, and write
the table `TritonExperts` reads (`src/tandem/modular_kernels/tile_tables.py`).

GEMM 1 (gate/up with SiLU-and-mul: N = I, K = H) and GEMM 2 (down: N = H, K = I) have
different shapes, so each gets its own tile; they share `block_m`, the block the align step
pads each expert's rows to. For each token count and each `block_m` the pairs are sorted
once, then every candidate (block_n, block_k, warps, stages) of GEMM 1 is timed alone, and
every candidate of GEMM 2 on GEMM 1's output; a candidate must agree with that GEMM's output
at the default tile. The `block_m` of least GEMM 1 + GEMM 2 time wins. The whole experts
call (align, both GEMMs, the pair sum) with the winning tiles is then timed against the
default tiles and must agree with their output; the faster of the two goes in the table.
Candidates whose pipelined tiles need more shared memory than an sm_90 block has (227 KiB)
are not compiled. Times are medians of `--repeat` calls (CUDA events on a GPU).

The table goes to `--out-dir` as `E={E},N={I},K={H},device={name}.json`; the run's figures
(per token count: each GEMM's best and default time, the whole call's) to
benchmarks/results/tune_moe_configs.json, and a table is printed.

    # on a GPU (DeepSeek-V2-Lite's experts; token counts of the review: decode, 256, prefill):
    python benchmarks/tune_moe_configs.py --experts 64 --inter 1408 --hidden 2048 --top-k 6
    # CPU: the Triton interpreter, a tiny shape and grid, outputs in a temporary folder
    python benchmarks/tune_moe_configs.py --smoke

Only a GPU gives tiles worth keeping; the smoke run checks the script end to end (tested).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: `block_m` and, per GEMM, the rest of the tile.
FULL_GRID = dict(
    block_m=(16, 32, 64, 128), block_n=(32, 64, 128, 256), block_k=(32, 64, 128, 256), num_warps=(4, 8),
    num_stages=(2, 3, 4, 5),
)  # fmt: skip
#: gpu-review-3 G10: BLOCK_K 128/256, 4-5 stages, N 32/64/128 for M16 (and the defaults' 64/3):
#: 121 candidates fit sm_90's shared memory in bf16 (each GEMM, each block_m), each one compile.
QUICK_GRID = dict(block_m=(16, 32, 64), block_n=(32, 64, 128), block_k=(64, 128, 256), num_warps=(4,), num_stages=(3, 4, 5))
SMOKE_GRID = dict(block_m=(16, 32), block_n=(16, 32), block_k=(32,), num_warps=(4,), num_stages=(2,))
#: The most shared memory one sm_90 block may use (H100 / H200).
SHARED_LIMIT = 227 * 1024


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--inter", type=int, default=1408, help="expert intermediate size (N of the table)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (K of the table)")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", default="64,256,2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--grid", choices=("full", "quick"), default="quick")
    p.add_argument("--out-dir", type=Path, default=None, help="where the table goes (default: the package's tile_tables/)")
    p.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/tune_moe_configs.json")
    p.add_argument("--smoke", action="store_true", help="CPU: Triton interpreter, tiny shape and grid")
    return p.parse_args()


def timed(fn, repeat: int, device) -> float:
    """Median milliseconds of `repeat` calls after one warm-up (which also compiles)."""
    import torch

    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def candidates(grid: dict, block_m: int, gated: bool, element_bytes: int) -> list:
    """One GEMM's tiles at `block_m` whose pipelined A and B tiles (B twice when gated: gate
    and up) fit an sm_90 block's shared memory; the estimate is what Triton allocated for
    the compiled tiles (120 KiB at 64x128x64, 3 stages, gated, bf16)."""
    from tandem.modular_kernels.tile_tables import TileConfig

    rest = [key for key in grid if key != "block_m"]
    tiles = [TileConfig(block_m=block_m, **dict(zip(rest, values))) for values in itertools.product(*(grid[k] for k in rest))]
    b_tiles = 2 if gated else 1
    return [
        t for t in tiles
        if t.num_stages * (t.block_m * t.block_k + b_tiles * t.block_k * t.block_n) * element_bytes <= SHARED_LIMIT
    ]  # fmt: skip


def fastest(run, reference, tiles: list, repeat: int, device) -> tuple:
    """The tile of least median time among those whose output agrees with `reference`."""
    import torch

    best, best_ms = None, float("inf")
    for tile in tiles:
        try:
            out = run(tile)
        except Exception as exc:  # noqa: BLE001 - a tile the device cannot run (resources, lowering)
            print(f"  skip {tile}: {type(exc).__name__}", file=sys.stderr)
            continue
        if not torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2):
            print(f"  skip {tile}: output differs from the default tile's", file=sys.stderr)
            continue
        ms = timed(lambda: run(tile), repeat, device)
        if ms < best_ms:
            best, best_ms = tile, ms
    return best, best_ms


def tune_block_m(problem, block_m: int, grid: dict, default, repeat: int, device) -> dict:
    """GEMM 1's and GEMM 2's fastest tiles at `block_m`, each timed alone, with the default
    tile's time (its block_n/k, warps, stages at this block_m) beside each."""
    import dataclasses

    from tandem.modular_kernels.experts_triton import down_gemm, gate_up_gemm, sort_pairs

    x, w1, w2, weights, ids = problem
    pairs = sort_pairs(ids, weights, w1.shape[0], block_m)
    base = dataclasses.replace(default, block_m=block_m)
    act = gate_up_gemm(x, w1, pairs, base)
    gemms = {
        "gemm1": (lambda tile: gate_up_gemm(x, w1, pairs, tile), act, True),
        "gemm2": (lambda tile: down_gemm(act, w2, pairs, tile), down_gemm(act, w2, pairs, base), False),
    }
    result = {}
    for name, (run, reference, gated) in gemms.items():
        tile, ms = fastest(run, reference, candidates(grid, block_m, gated, x.element_size()), repeat, device)
        default_ms = timed(lambda: run(base), repeat, device)
        if tile is None or default_ms <= ms:
            tile, ms = base, default_ms
        result[name] = dict(tile=tile, ms=ms, default_ms=default_ms)
    return result


def tune_one(args, num_tokens: int, grid: dict, device, dtype) -> dict:
    import torch

    from tandem.modular_kernels import ExpertTokens, select_experts
    from tandem.modular_kernels.experts_triton import TritonExperts
    from tandem.modular_kernels.tile_tables import ExpertTiles, default_tiles

    g = torch.Generator(device="cpu").manual_seed(num_tokens)
    E, I, H = args.experts, args.inter, args.hidden
    x = torch.randn(num_tokens, H, generator=g).to(device=device, dtype=dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device=device, dtype=dtype)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=g).to(device), args.top_k, renormalize=True)
    default = default_tiles(num_tokens, args.top_k, E)
    per_block_m = [tune_block_m((x, w1, w2, weights, ids), m, grid, default.gemm1, args.repeat, device) for m in grid["block_m"]]
    won = min(per_block_m, key=lambda r: r["gemm1"]["ms"] + r["gemm2"]["ms"])
    tuned = ExpertTiles(won["gemm1"]["tile"], won["gemm2"]["tile"])

    tokens = ExpertTokens(x, None, dtype, topk_ids=ids, topk_weights=weights)
    reference = TritonExperts(tiles=default).apply(tokens, w1, w2)
    out = TritonExperts(tiles=tuned).apply(tokens, w1, w2)
    if not torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2):
        raise AssertionError(f"{num_tokens} tokens: the tuned tiles {tuned} change the experts' output")
    default_ms = timed(lambda: TritonExperts(tiles=default).apply(tokens, w1, w2), args.repeat, device)
    tuned_ms = timed(lambda: TritonExperts(tiles=tuned).apply(tokens, w1, w2), args.repeat, device)
    best, best_ms = (tuned, tuned_ms) if tuned_ms < default_ms else (default, default_ms)
    gemms = {name: dict(ms=won[name]["ms"], default_ms=won[name]["default_ms"]) for name in ("gemm1", "gemm2")}
    return dict(tokens=num_tokens, best=best.as_dict(), best_ms=best_ms, default=default.as_dict(), default_ms=default_ms, **gemms)


def _tile_text(tile: dict) -> str:
    return f"{tile['block_m']}x{tile['block_n']}x{tile['block_k']} w{tile['num_warps']} s{tile['num_stages']}"


def report(args, name: str, rows: list[dict], table_path: Path) -> None:
    print(f"E={args.experts} N={args.inter} K={args.hidden} top-{args.top_k} {args.dtype} on {name}, median of {args.repeat}")
    print(f"{'tokens':>7} {'default ms':>11} {'best ms':>9} {'speed-up':>9} {'GEMM 1 ms (default)':>20} "
          f"{'GEMM 2 ms (default)':>20}  GEMM 1 tile / GEMM 2 tile (m x n x k, warps, stages)")  # fmt: skip
    for r in rows:
        g1, g2 = r["gemm1"], r["gemm2"]
        print(f"{r['tokens']:>7} {r['default_ms']:>11.3f} {r['best_ms']:>9.3f} {r['default_ms'] / r['best_ms']:>8.2f}x "
              f"{g1['ms']:>9.3f} ({g1['default_ms']:>8.3f}) {g2['ms']:>9.3f} ({g2['default_ms']:>8.3f})  "
              f"{_tile_text(r['best']['gemm1'])} / {_tile_text(r['best']['gemm2'])}")  # fmt: skip
    print(f"table: {table_path}")


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.experts, args.inter, args.hidden, args.top_k, args.tokens, args.repeat = 4, 32, 64, 2, "1,4", 2
        args.dtype = "float32"
        scratch = Path(tempfile.mkdtemp(prefix="tune_moe_smoke_"))  # interpreter timings are worth nothing
        args.out_dir, args.json = args.out_dir or scratch, args.json or scratch / "tune_moe_configs.json"
    import torch

    from tandem.modular_kernels import tile_tables

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    grid = SMOKE_GRID if args.smoke else (FULL_GRID if args.grid == "full" else QUICK_GRID)
    name = "cpu-interpreter" if args.smoke else tile_tables.device_name(device)
    rows = [tune_one(args, int(t), grid, device, dtype) for t in args.tokens.split(",")]

    out_dir = args.out_dir or tile_tables.TABLE_DIR
    table_path = out_dir / tile_tables.table_name(args.experts, args.inter, args.hidden, name)
    tile_tables.write_table(table_path, {r["tokens"]: tile_tables.ExpertTiles.from_dict(r["best"]) for r in rows})
    report(args, name, rows, table_path)
    args.json = args.json or ROOT / "benchmarks/results/tune_moe_configs.json"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(
        command=" ".join(sys.argv), device=name, experts=args.experts, inter=args.inter, hidden=args.hidden,
        top_k=args.top_k, dtype=args.dtype, repeat=args.repeat, grid=grid, table=str(table_path), rows=rows,
    ), indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
