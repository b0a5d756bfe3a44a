"""`tandem serve` in several settings on one checkpoint, driven by vLLM's client: an A/B of
serve flags (or environment) on a drifting machine, the variants interleaved per round.

Each variant is `name:ENV=VALUE:flags` (ENV may be empty). For each round and variant, one
server starts, `vllm bench serve` runs at each concurrency (as `vs_vllm.py` drives it), and
the engine's mean step time under that load is read from `/metrics`. The table gives the
median over the rounds and each variant's output tok/s against the first variant's.

    python benchmarks/serve_ab.py --model mixtral \\
        --variants "auto::--cpu-threads auto;fixed::--cpu-threads fixed;one:OMP_NUM_THREADS=1:--cpu-threads fixed"

Results go to benchmarks/results/serve_ab.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_vllm  # noqa: E402
from tandem.testing.load import metric  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "serve_ab.json"
STEP_METRICS = ("tandem_engine_steps_total", "tandem_engine_step_time_seconds_total")


def parse_variants(text: str) -> list[tuple[str, dict, tuple[str, ...]]]:
    variants = []
    for item in filter(None, text.split(";")):
        parts = item.split(":", 2)
        if len(parts) != 3:
            raise SystemExit(f"a variant is name:ENV=VALUE:flags (ENV may be empty), got {item!r}")
        name, env, flags = parts
        if env and "=" not in env:
            raise SystemExit(f"variant {name}: the environment part must be ENV=VALUE, got {env!r}")
        variants.append((name, dict([env.split("=", 1)]) if env else {}, tuple(flags.split())))
    return variants


def step_counters(base: str) -> dict[str, float]:
    return {name: metric(base, name) for name in STEP_METRICS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mixtral", help=f"one of {', '.join(vs_vllm.MODELS)}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--variants", required=True, help="name:ENV=VALUE:flags;... (the first is the baseline)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-concurrency", type=int, default=4)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    model_dir = vs_vllm.checkpoint(args.model)
    base_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrencies} for name, _, _ in variants}
    for round_index in range(args.repeat):
        for name, env, flags in variants:
            os.environ.clear()
            os.environ.update(base_env | env)
            server = vs_vllm.ServerProcess("tandem", model_dir, 600, dtype=args.dtype, tandem_args=flags)
            try:
                for concurrency in concurrencies:
                    before = step_counters(server.base)
                    bench = vs_vllm.bench_serve(server, model_dir, concurrency, args, seed=round_index)
                    after = step_counters(server.base)
                    steps = after[STEP_METRICS[0]] - before[STEP_METRICS[0]]
                    bench["step_ms"] = 1000 * (after[STEP_METRICS[1]] - before[STEP_METRICS[1]]) / steps if steps else None
                    runs[name][concurrency].append(bench)
                    vs_vllm.log(f"round {round_index} {name} c={concurrency}: {bench['output_tok_s']:.0f} tok/s, "
                                f"TPOT {bench['tpot_ms']:.2f} ms, step {bench['step_ms'] or 0:.2f} ms")
            finally:
                server.stop()
    os.environ.clear()
    os.environ.update(base_env)
    summary = {
        name: {c: {key: statistics.median(r[key] for r in runs[name][c]) for key in ("output_tok_s", "tpot_ms", "step_ms")}
               for c in concurrencies}
        for name, _, _ in variants
    }
    baseline = variants[0][0]
    print(f"\n{args.model} {args.dtype}, median of {args.repeat} interleaved rounds; ratio: tok/s over {baseline}'s\n")
    print("| variant | c | output tok/s | ratio | TPOT ms | mean step ms |\n|---|---|---|---|---|---|")
    for name, _, _ in variants:
        for c in concurrencies:
            s = summary[name][c]
            ratio = s["output_tok_s"] / summary[baseline][c]["output_tok_s"]
            print(f"| {name} | {c} | {s['output_tok_s']:.0f} | {ratio:.2f}x | {s['tpot_ms']:.2f} | {s['step_ms']:.2f} |")
    record = {
        "command": " ".join(sys.argv), "model": args.model, "dtype": args.dtype, "repeat": args.repeat,
        "variants": [{"name": n, "env": e, "flags": list(f)} for n, e, f in variants],
        "summary": summary, "runs": runs, "cpu_count": os.cpu_count(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
