"""Engine output tokens/s of one model in four step modes, the model loaded once: eager, full
CUDA graphs (decode replayed), DBO eager, DBO + full graphs (`--modes`). The `Engine` as
`tandem serve` runs it (overlapped scheduler loop), in-process, one rank: `--requests`
requests of `--prompt-len` random tokens, each generating `--max-tokens` tokens, greedy,
ignore_eos. Medians over `--repeat` runs after `--warmup`; the modes interleave per run.

    python benchmarks/engine_tok_s.py                                   # GPU: DeepSeek-V2-Lite shape
    python benchmarks/engine_tok_s.py --device cpu --model tiny-moe --requests 4 --max-tokens 4 \
        --modes eager,dbo --repeat 1 --warmup 0                         # CPU smoke check

Prints a table; writes benchmarks/results/engine_tok_s.json (or --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
#: Mode -> the OverlapConfig fields it sets (DBO on every step: thresholds 0). Eager says so:
#: `--graph-mode auto`, the default, is graphs on CUDA.
MODES = {
    "eager": {"graph_mode": "none"},
    "graphs": {"graph_mode": "full"},
    "dbo": {"enable_dbo": True, "dbo_decode_token_threshold": 0, "dbo_prefill_token_threshold": 0, "graph_mode": "none"},
    "dbo+graphs": {"enable_dbo": True, "dbo_decode_token_threshold": 0, "dbo_prefill_token_threshold": 0,
                   "graph_mode": "full"},
}


def _config(args):
    from tandem.config import CacheConfig, EngineConfig, ParallelConfig

    blocks = args.requests * -(-(args.prompt_len + args.max_tokens) // 16) + 1
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        parallel=ParallelConfig(all2all_backend="local", moe_backend=args.moe_backend),
        cache=CacheConfig(num_kv_blocks=blocks, block_size=16),
        max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
    )


def _runner_for(base, config, mode: str):
    """A runner over `base`'s loaded model with `mode`'s overlap settings (its own KV cache)."""
    from tandem.worker.model_runner import ModelRunner

    overlap = dataclasses.replace(config.overlap, **MODES[mode])
    return ModelRunner(base.info, overlap=overlap, num_kv_blocks=config.cache.num_kv_blocks,
                       block_size=config.cache.block_size, config=dataclasses.replace(config, overlap=overlap))


def _tok_s(args, runner, seed: int) -> float:
    from tandem.bench.engine_rate import output_tok_s
    from tandem.config import SchedulerConfig
    from tandem.engine.build import build_engine

    config = dataclasses.replace(runner.config, scheduler=SchedulerConfig(max_num_seqs=args.requests),
                                 max_num_batched_tokens=args.requests * args.prompt_len)
    engine = build_engine(config, runner=runner)
    return output_tok_s(engine, requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens, seed=seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v2-lite-random")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--moe-backend", default=None, help="default: triton on CUDA, torch on the CPU")
    parser.add_argument("--modes", default="eager,graphs,dbo,dbo+graphs")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "engine_tok_s.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("engine_tok_s.py --device cuda needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    args.moe_backend = args.moe_backend or ("triton" if args.device == "cuda" else "torch")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; pick from {', '.join(MODES)}")
    from tandem.worker.build import build_runner

    config = _config(args)
    base = build_runner(config)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for run in range(args.warmup + args.repeat):
        for mode in modes:  # interleaved: drift on a shared machine hits every mode alike
            runner = _runner_for(base, config, mode)
            rate = _tok_s(args, runner, seed=run)
            if run >= args.warmup:
                rates[mode].append(rate)
            del runner
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    table = {m: statistics.median(v) for m, v in rates.items()}
    print(f"{args.model} on {device}, {args.requests} requests x {args.max_tokens} tokens (prompt {args.prompt_len}), "
          f"moe {args.moe_backend}, median of {args.repeat}")
    print(f"| mode | output tok/s | vs eager |\n|---|---|---|")
    for mode, rate in table.items():
        ratio = f"{rate / table['eager']:.2f}x" if "eager" in table else "-"
        # gpu-review-3 G13: one rank, local dispatch, nothing to hide: DBO measures its cost.
        label = f"{mode} (1 rank, local: overhead only)" if "dbo" in mode else mode
        print(f"| {label} | {rate:.1f} | {ratio} |")
    out = {"device": device, "settings": vars(args), "output_tok_s": table, "runs": rates}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
