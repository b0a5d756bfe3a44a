"""Tune the Triton grouped GEMM's tile sizes for one MoE shape, per token count, and write
the table `TritonExperts` reads (`src/tandem/modular_kernels/tile_tables.py`).

For each token count: every candidate tile (block_m/n/k, warps, stages) runs the whole
STANDARD-format experts call (align, both grouped GEMMs, the sum) on random routing; the
median of `--repeat` timed calls (CUDA events on a GPU) picks the best, which must agree
with the default tile's output. The table goes to `--out-dir` as
`E={E},N={I},K={H},device={name}.json`; the run's figures (best vs default per token count)
to benchmarks/results/tune_moe_configs.json, and a table is printed.

    # on a GPU (DeepSeek-V2-Lite's experts):
    python benchmarks/tune_moe_configs.py --experts 64 --inter 1408 --hidden 2048 --top-k 6
    # CPU smoke: the Triton interpreter, a tiny shape and grid, outputs in a temporary folder
    python benchmarks/tune_moe_configs.py --smoke

Only a GPU gives tiles worth keeping; the smoke run checks the script end to end.
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
FULL_GRID = dict(block_m=(16, 32, 64, 128), block_n=(32, 64, 128), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))
QUICK_GRID = dict(block_m=(16, 32, 64), block_n=(64, 128), block_k=(64, 128), num_warps=(4, 8), num_stages=(3,))
SMOKE_GRID = dict(block_m=(16, 32), block_n=(32,), block_k=(32,), num_warps=(4,), num_stages=(2,))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--inter", type=int, default=1408, help="expert intermediate size (N of the table)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (K of the table)")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", default="1,8,16,32,64,128,256,512,1024,2048,4096")
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


def tune_one(args, num_tokens: int, grid: dict, device, dtype) -> dict:
    import torch

    from tandem.modular_kernels import ExpertTokens, select_experts
    from tandem.modular_kernels.experts_triton import TritonExperts
    from tandem.modular_kernels.tile_tables import TileConfig, default_config

    g = torch.Generator(device="cpu").manual_seed(num_tokens)
    E, I, H = args.experts, args.inter, args.hidden
    x = torch.randn(num_tokens, H, generator=g).to(device=device, dtype=dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device=device, dtype=dtype)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=g).to(device), args.top_k, renormalize=True)
    tokens = ExpertTokens(x, None, dtype, topk_ids=ids, topk_weights=weights)
    default = default_config(num_tokens, args.top_k, E)
    reference = TritonExperts(tile=default).apply(tokens, w1, w2)
    default_ms = timed(lambda: TritonExperts(tile=default).apply(tokens, w1, w2), args.repeat, device)
    best, best_ms = default, default_ms
    for values in itertools.product(*grid.values()):
        tile = TileConfig(**dict(zip(grid, values)))
        experts = TritonExperts(tile=tile)
        try:
            out = experts.apply(tokens, w1, w2)
        except Exception as exc:  # noqa: BLE001 - a tile the device cannot run (shared memory, registers)
            print(f"  skip {tile}: {type(exc).__name__}", file=sys.stderr)
            continue
        if not torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2):
            print(f"  skip {tile}: output differs from the default tile's", file=sys.stderr)
            continue
        ms = timed(lambda: experts.apply(tokens, w1, w2), args.repeat, device)
        if ms < best_ms:
            best, best_ms = tile, ms
    return dict(tokens=num_tokens, best=best.as_dict(), best_ms=best_ms, default=default.as_dict(), default_ms=default_ms)


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
    tile_tables.write_table(table_path, {r["tokens"]: tile_tables.TileConfig(**r["best"]) for r in rows})

    print(f"E={args.experts} N={args.inter} K={args.hidden} top-{args.top_k} {args.dtype} on {name}, median of {args.repeat}")
    print(f"{'tokens':>7} {'default ms':>11} {'best ms':>9} {'speed-up':>9}  best tile (m, n, k, warps, stages)")
    for r in rows:
        b = r["best"]
        tile = f"{b['block_m']}, {b['block_n']}, {b['block_k']}, {b['num_warps']}, {b['num_stages']}"
        print(f"{r['tokens']:>7} {r['default_ms']:>11.3f} {r['best_ms']:>9.3f} {r['default_ms'] / r['best_ms']:>8.2f}x  {tile}")
    print(f"table: {table_path}")
    args.json = args.json or ROOT / "benchmarks/results/tune_moe_configs.json"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(
        command=" ".join(sys.argv), device=name, experts=args.experts, inter=args.inter, hidden=args.hidden,
        top_k=args.top_k, dtype=args.dtype, repeat=args.repeat, table=str(table_path), rows=rows,
    ), indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
