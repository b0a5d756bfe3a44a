"""The GPU benchmark, one command for a machine with a CUDA GPU:

    python benchmarks/gpu.py                       # DeepSeek-V2-Lite-shaped, random weights
    python benchmarks/gpu.py --model tiny-moe --decode-tokens 32,64 --prefill-tokens 512 --repeat 3   # quick check

1. Step time of no overlap, DBO, SBO and DBO+SBO for decode at 32..512 tokens and for
   prefill, on one GPU with the modelled interconnect on the GPU itself (`--fabric`, default
   DeepEP low-latency on H800, EP8): each dispatch and combine is a spin kernel on the comm
   stream lasting the fabric model's time, so overlap shows on real streams
   (`tandem.modular_kernels.device_fabric`). This is `tandem bench --device cuda
   --data-parallel-size 1` run through the same sweep code.
2. Output tokens/s of the overlapped against the normal scheduler loop (the `Engine` as
   `tandem serve` runs it, in-process): `--requests` requests of `--prompt-len` prompt tokens
   each generating `--max-tokens` tokens, greedy, ignore_eos.

Medians over `--repeat` runs; ratios from this one run. Writes benchmarks/results/gpu.json
and prints the tables. Needs CUDA; on a machine without it, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _engine(args, **overrides):
    """One rank on the GPU, no overlap configured (the sweep switches modes per step)."""
    from tandem.config import EngineConfig, OverlapConfig, ParallelConfig

    return EngineConfig(
        model=args.model,
        overlap=OverlapConfig(dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0, graph_mode="none"),
        parallel=ParallelConfig(all2all_backend="local", moe_backend=args.moe_backend),
        device=args.device,
        dtype=args.dtype,
        **overrides,
    )


def _sweep(args, phase: str, tokens: list[int]) -> tuple[list[dict], dict | None]:
    """One sweep in its own rank process (its GPU memory is freed when it exits)."""
    from tandem.bench import rows_from_sweep
    from tandem.bench.sweep import BenchSpec, run_sweep

    engine = _engine(args)
    spec = BenchSpec(
        model=args.model, data_parallel_size=1, grids=[(phase, tokens)], modes=args.modes, repeat=args.repeat,
        warmup=args.warmup, fabric=args.fabric if args.device == "cuda" else None, num_ubatches=2,
        all2all_backend="local", context_len=args.context_len, prefill_len=args.prefill_len, engine_config=engine,
        device=args.device, dtype=args.dtype,
    )
    result = run_sweep(spec)
    return rows_from_sweep(result, phase, args.modes), result.get("fabric")


def _loop_runner(args):
    """One model for both loops (a second copy of a 31 GB model would not fit beside it)."""
    from tandem.config import CacheConfig
    from tandem.engine.offline import build_runner

    blocks = args.requests * -(-(args.prompt_len + args.max_tokens) // 16) + 1
    return build_runner(_engine(args, cache=CacheConfig(num_kv_blocks=blocks, block_size=16)))


def _loop_throughput(args, runner, overlap_schedule: bool) -> float:
    import dataclasses

    from tandem.bench.engine_rate import output_tok_s
    from tandem.config import SchedulerConfig
    from tandem.engine.build import build_engine

    config = dataclasses.replace(
        runner.config, scheduler=SchedulerConfig(max_num_seqs=args.requests, overlap_schedule=overlap_schedule)
    )
    rates = []
    for run in range(args.warmup + args.repeat):
        engine = build_engine(config, runner=runner)
        rate = output_tok_s(engine, requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                            seed=run, lowest_token=0)
        if run >= args.warmup:
            rates.append(rate)
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v2-lite-random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--moe-backend", default=None, help="default: triton when importable, else torch")
    parser.add_argument("--fabric", default="deepep-ll-h800")
    parser.add_argument("--decode-tokens", default="32,64,128,256,512")
    parser.add_argument("--prefill-tokens", default="2048")
    parser.add_argument("--modes", default="none,dbo,sbo,dbo+sbo")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="scheduler-loop comparison: requests")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu only smoke-checks this script (no modelled fabric, tiny sizes); figures come from cuda",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    if args.moe_backend is None:
        args.moe_backend = "torch"
        if args.device == "cuda":
            try:
                import triton  # noqa: F401

                args.moe_backend = "triton"
            except ImportError:
                pass
    args.modes = [m for m in args.modes.split(",") if m]
    from tandem.bench.report import format_table

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke check, machine shared)"
    out: dict = {"device": device, "settings": {k: v for k, v in vars(args).items() if k != "json"}, "phases": {}}
    for phase, grid in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
        tokens = sorted({int(t) for t in grid.split(",") if t})
        if not tokens:
            continue
        rows, fabric = _sweep(args, phase, tokens)
        out["phases"][phase] = rows
        out["fabric_model"] = fabric
        # gpu-review-3 G13: one GPU moves no token between ranks; its DBO/SBO rows hide a
        # modelled transfer (a spin on the GPU), an upper bound, never a measured overlap.
        where = (f"1 GPU, modelled fabric {args.fabric} ({fabric}): DBO/SBO rows are an upper bound"
                 if args.device == "cuda" else "no fabric")
        print(f"\n{args.model} on {device}, {phase}, {where}, moe={args.moe_backend}")
        print(format_table(rows))
    runner = _loop_runner(args)
    loops = {name: _loop_throughput(args, runner, overlap) for name, overlap in (("overlapped", True), ("normal", False))}
    out["scheduler_loop_tok_s"] = loops
    print(f"\nscheduler loop, {args.requests} requests x {args.max_tokens} tokens (prompt {args.prompt_len}), {device}")
    print(f"{'loop':<12}{'tok/s':>10}")
    for name, rate in loops.items():
        print(f"{name:<12}{rate:>10.1f}")
    print(f"overlapped / normal: {loops['overlapped'] / loops['normal']:.3f}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
