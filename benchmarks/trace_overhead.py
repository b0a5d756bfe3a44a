"""Cost of the overlap timeline (`--trace`) with tracing off and on, in one run:

- a `dbo_yield` loop (two ubatches, per switch), for both executors, under the time model
  (`time_model(CommCounters())`: how a runner step runs) without and with a `Tracer`;
- a tiny-moe model step (`ModelRunner.execute`, one rank, DBO on the local backend:
  decode batch, two ubatches yielding at every MoE transfer point) without and with one.

Off and on are interleaved, median of --runs. Run it with `PYTHONPATH` on a tree without
tracing (where `tandem.contexts.trace` does not exist) to get the "off" columns of code
that has no hook at all.

    python benchmarks/trace_overhead.py [--switches 20000] [--steps 50] [--runs 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tandem import dbo_yield, run_ubatches
from tandem.contexts import CommCounters, make_executor, time_model

try:
    from tandem.contexts.trace import Tracer
except ImportError:  # a tree from before tracing: measure "off" only
    Tracer = None


def yield_switch_s(executor, switches: int, tracer) -> float:
    per_ubatch = switches // 2

    def ubatch() -> None:
        for _ in range(per_ubatch):
            dbo_yield()

    counters = CommCounters() if tracer is None else CommCounters(tracer=tracer)
    start = time.perf_counter()
    with time_model(counters):
        run_ubatches([ubatch, ubatch], executor=executor)
    return (time.perf_counter() - start) / (2 * per_ubatch)


def tiny_moe_runner(tokens: int):
    from tandem.config import CacheConfig, EngineConfig, OverlapConfig
    from tandem.worker.step_inputs import ScheduledChunk
    from tandem.engine.offline import build_runner
    from tandem.worker.sampling import SamplingParams

    config = EngineConfig(
        model="tiny-moe",
        overlap=OverlapConfig(enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0),
        cache=CacheConfig(num_kv_blocks=tokens * 2 + 1, block_size=16),
    )
    runner = build_runner(config)
    blocks = [runner.allocator.allocate(2) for _ in range(tokens)]
    chunks = [ScheduledChunk([65 + r % 100], 20, blocks[r]) for r in range(tokens)]
    params = [SamplingParams(max_tokens=1)] * tokens

    def steps_s(count: int, tracer) -> float:
        runner.tracer = tracer
        start = time.perf_counter()
        for _ in range(count):
            runner.execute(chunks, params, [None] * tokens)
        return (time.perf_counter() - start) / count

    return runner, steps_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switches", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=50, help="tiny-moe steps per timed run")
    parser.add_argument("--tokens", type=int, default=64, help="tiny-moe decode batch (tokens)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "trace_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tracing = Tracer is not None

    rows = []
    for kind in ("greenlet", "thread"):
        executor = make_executor(kind)
        yield_switch_s(executor, 1000, None)  # warm the worker threads
        off, on = [], []
        for _ in range(args.runs):
            off.append(yield_switch_s(executor, args.switches, None))
            if tracing:
                on.append(yield_switch_s(executor, args.switches, Tracer(0)))
        rows.append(_row(f"dbo_yield ({kind})", "µs per switch", off, on, 1e6))
        executor.close()

    runner, steps_s = tiny_moe_runner(args.tokens)
    steps_s(3, None)  # warm-up
    off, on, export = [], [], []
    for _ in range(args.runs):
        off.append(steps_s(args.steps, None))
        if tracing:
            tracer = Tracer(0)
            on.append(steps_s(args.steps, tracer))
            start = time.perf_counter()
            json.dumps(tracer.events())
            export.append((time.perf_counter() - start) / args.steps)
    rows.append(_row(f"tiny-moe step ({args.tokens} tokens, DBO)", "ms per step", off, on, 1e3))
    if tracing:
        rows[-1]["export_ms_per_step"] = round(statistics.median(export) * 1e3, 4)

    print(f"{'case':<34}{'unit':>14}{'off':>10}{'on':>10}{'on/off':>8}")
    for r in rows:
        on_text = f"{r['on']:>10.3f}{r['on_over_off']:>8.3f}" if tracing else f"{'n/a':>10}{'':>8}"
        print(f"{r['case']:<34}{r['unit']:>14}{r['off']:>10.3f}{on_text}")
    if tracing:
        print(f"writing the trace (events() + JSON) afterwards: {rows[-1]['export_ms_per_step']:.3f} ms per tiny-moe step")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    config = {"switches": args.switches, "steps": args.steps, "tokens": args.tokens, "runs": args.runs,
              "tracing_available": tracing, "python": platform.python_version(), "machine": platform.machine()}
    args.json.write_text(json.dumps({"rows": rows, "config": config}, indent=2) + "\n")
    print(f"wrote {args.json}")


def _row(case: str, unit: str, off: list[float], on: list[float], scale: float) -> dict:
    row = {"case": case, "unit": unit, "off": round(statistics.median(off) * scale, 4),
           "off_spread": [round(min(off) * scale, 4), round(max(off) * scale, 4)]}
    if on:
        row.update(on=round(statistics.median(on) * scale, 4), on_spread=[round(min(on) * scale, 4), round(max(on) * scale, 4)])
        # The ratio from paired runs (interleaved), so a load change hits both sides.
        row["on_over_off"] = round(statistics.median(b / a for a, b in zip(off, on)), 4)
    return row


if __name__ == "__main__":
    main()
