"""Pipeline parallelism on tiny-moe: decode throughput with micro-batches in flight, and the
time to first token of one long prompt with chunked pipeline prefill.

Decode: `--streams` concurrent greedy requests (`ignore_eos`) decode `--decode-tokens` tokens
each; tok/s counts the tokens generated after every stream has its first one. Modes: pp1 (one
process, the default overlapped loop), pp2 (two stages, 2 micro-batches in flight), pp2 with
one micro-batch in flight (the bubble baseline: a stage idles while the other works) and pp2
with async depth 1 (3 in flight). Each stage's idle fraction is its share of the decode window
spent waiting (stage 0: for results, stage 1: for its next micro-batch).

Prefill: one `--prompt-len`-token prompt, `max_tokens=1`; TTFT of pp1 and pp2, with fixed
chunks of `--chunk` tokens and with dynamic chunking (quadratic latency model fitted at start).

Every figure comes from one launch of two rank processes (rank 0 also runs pp1 with a whole
model while rank 1 waits); modes are interleaved per repeat and the table shows the median
(min-max) over `--repeat` runs, ratios from those medians. The model is tiny-moe's weights in a
directory whose context is raised to fit the long prompt.

    python benchmarks/pipeline.py                 # ~3-5 min on a quiet 2-core machine
    python benchmarks/pipeline.py --repeat 5 --prompt-len 8192

Writes benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

DECODE_MODES = [("pp1", None), ("pp2", 2), ("pp2 1 micro-batch", 1), ("pp2 depth 1", 3)]
PREFILL_MODES = [("pp1 fixed", False), ("pp1 dynamic", True), ("pp2 fixed", False), ("pp2 dynamic", True)]


def make_model_dir(directory: Path, context: int) -> str:
    from tandem.models.tiny_moe import save_tiny_moe

    path = save_tiny_moe(directory)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def _decode_run(engine, tokenizer, args, tag: str, stage_stats=None) -> dict:
    from tandem.worker.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"{tag}-{i}", tokenizer.encode(f"stream {i}: pipeline stages").ids, params)
    started: set[str] = set()
    tokens, window_start, before = 0, None, None
    while engine.has_work:
        for out in engine.step():
            if window_start is not None:
                tokens += len(out.new_token_ids)
            started.add(out.request_id)
        if window_start is None and len(started) == args.streams:
            window_start = time.perf_counter()
            before = stage_stats() if stage_stats else None
    elapsed = time.perf_counter() - window_start
    result = {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}
    if stage_stats:
        after = stage_stats()
        from tandem.engine.pipeline import StageCounters

        result["idle_fraction"] = [
            _window_idle(before.get(s, StageCounters()), after.get(s, StageCounters())) for s in range(2)
        ]
    return result


def _window_idle(before, after) -> float:
    """The idle fraction of one stage between two `StageCounters` snapshots."""
    busy = after.busy_s - before.busy_s
    idle = after.idle_s - before.idle_s
    return idle / (busy + idle) if busy + idle > 0 else 0.0


def _ttft(engine, args, tag: str) -> float:
    from tandem.worker.sampling import SamplingParams

    prompt = [(7 * i) % 250 + 1 for i in range(args.prompt_len)]
    start = time.perf_counter()
    engine.add_request(tag, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    first = None
    while engine.has_work:
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter() - start
    return first


def _link_round_trip_ms(groups, count: int = 40) -> float:
    """Median round trip of a decode-sized tensor dict (32 x 64 hidden states and a plan)
    between the two stages: the transfer cost every micro-batch pays twice."""
    import torch

    from tandem.distributed import StageLink

    peer = 1 - groups.rank
    link = StageLink(peer, cpu_group=groups.cpu_group, device_group=groups.device_group)
    message = {"plan": list(range(200)), "hidden": torch.randn(32, 64)}
    times = []
    link.expect()  # as the pipeline does: each side's receive is posted before the peer sends
    for i in range(count):
        start = time.perf_counter()
        if groups.rank == 0:
            link.send(message).wait()
            received = link.recv()
        else:
            received = link.recv()
        if i < count - 1:
            link.expect()
        if groups.rank == 1:
            link.send(received).wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_rank(rank: int, world: int, args) -> dict:
    import torch
    import torch.distributed as dist

    from tandem.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from tandem.engine.build import build_engine, build_pipeline_stage
    from tandem.engine.chunking import fit_chunker
    from tandem.worker.build import build_runner
    from tandem.engine.pipeline import PipelineEngine, run_stage

    torch.set_num_threads(1)
    blocks = (args.prompt_len + args.streams * 64) // 16 + 64
    partition = [int(n) for n in args.pp_layer_partition.split(",")] if args.pp_layer_partition else None
    config = EngineConfig(
        model=args.model_dir, parallel=ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=partition),
        cache=CacheConfig(num_kv_blocks=blocks, block_size=16), max_num_batched_tokens=args.chunk,
    )
    runner, groups = build_pipeline_stage(config)
    link_rtt_ms = _link_round_trip_ms(groups)
    # pp1 runs on rank 0 alone: its DP agreement must not wait for rank 1 (new_group is collective).
    alone = dist.new_group([0], backend="gloo")
    if groups.stage == 1:
        run_stage(runner, groups, num_micro_batches=3, step_timeout_s=3600)
        return {}
    whole_config = EngineConfig(model=config.model, cache=config.cache, max_num_batched_tokens=config.max_num_batched_tokens,
                                scheduler=SchedulerConfig(max_num_seqs=args.streams))
    whole = build_runner(whole_config, group=alone)
    tokenizer = runner.info.tokenizer

    def pipeline(num_micro_batches: int) -> PipelineEngine:
        return PipelineEngine(runner, groups, SchedulerConfig(max_num_seqs=args.streams, step_timeout_s=3600),
                              num_micro_batches=num_micro_batches, max_num_batched_tokens=args.chunk)

    # Fit the chunkers once (each on the layers it runs), then interleave the modes per repeat.
    chunk_pp1 = fit_chunker(whole, args.chunk)
    probe = pipeline(2)
    chunk_pp2 = fit_chunker(runner, args.chunk, probe.worker.forward_first)
    probe.heartbeat()
    decode: dict[str, list] = {name: [] for name, _ in DECODE_MODES}
    prefill: dict[str, list] = {name: [] for name, _ in PREFILL_MODES}
    for r in range(args.repeat):
        for name, micro_batches in DECODE_MODES:
            tag = f"d{r}-{name}"
            if micro_batches is None:
                engine = build_engine(whole_config, runner=whole)
                decode[name].append(_decode_run(engine, tokenizer, args, tag))
                engine.close()
            else:
                engine = pipeline(micro_batches)
                stats = lambda e=engine: {**e.stage_stats, 0: dataclasses.replace(e.worker.counters)}  # noqa: E731
                decode[name].append(_decode_run(engine, tokenizer, args, tag, stats))
                engine.heartbeat()
            print(f"[pipeline bench] run {r + 1} {name}: {decode[name][-1]['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
        for name, dynamic in PREFILL_MODES:
            tag = f"p{r}-{name}"
            if name.startswith("pp1"):
                engine = build_engine(dataclasses.replace(whole_config, scheduler=SchedulerConfig(overlap_schedule=False)),
                                      runner=whole)
                engine.scheduler.chunk_limit = chunk_pp1 if dynamic else None
            else:
                engine = pipeline(2)
                engine.scheduler.chunk_limit = chunk_pp2 if dynamic else None
            prefill[name].append(_ttft(engine, args, tag))
            if not name.startswith("pp1"):
                engine.heartbeat()
            print(f"[pipeline bench] run {r + 1} {name}: TTFT {prefill[name][-1]:.2f} s", file=sys.stderr, flush=True)
    probe.close()  # stops stage 1
    return {
        "decode": decode, "prefill": prefill, "link_rtt_ms": link_rtt_ms,
        "chunkers": {"pp1": [chunk_pp1(n) for n in (0, 2048, 4096, 6144)], "pp2": [chunk_pp2(n) for n in (0, 2048, 4096, 6144)]},
    }


def _median(values):
    return statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024, help="Fixed chunk / step token budget.")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--pp-layer-partition", default="1,2",
        help="tiny-moe's 3 layers over the 2 stages; 1,2 balances them (the first stage also embeds and "
        "schedules); '' for the even default (2,1).",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "pipeline.json")
    args = parser.parse_args()

    from tandem.testing.distributed import run_distributed

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = make_model_dir(Path(tmp) / "tiny-moe-long", args.prompt_len + 256)
        result = run_distributed(bench_rank, 2, args, timeout_s=3600)[0]
    decode, prefill = result["decode"], result["prefill"]

    rows = []
    for name, micro_batches in DECODE_MODES:
        runs = decode[name]
        tok_s = [run["tok_s"] for run in runs]
        idle = [statistics.median(run["idle_fraction"][s] for run in runs) for s in range(2)] if micro_batches else None
        rows.append({"mode": name, "micro_batches": micro_batches or 1, "tok_s": _median(tok_s), "min": min(tok_s),
                     "max": max(tok_s), "idle_fraction": idle})
    by = {row["mode"]: row["tok_s"] for row in rows}
    ratios = {
        "pp2 / pp2 1 micro-batch": by["pp2"] / by["pp2 1 micro-batch"],
        "pp2 / pp1": by["pp2"] / by["pp1"],
        "pp2 depth 1 / pp1": by["pp2 depth 1"] / by["pp1"],
    }
    ttft = {name: {"median_s": _median(v), "min_s": min(v), "max_s": max(v)} for name, v in prefill.items()}
    ttft_ratios = {
        "pp2 fixed / pp1 fixed": ttft["pp2 fixed"]["median_s"] / ttft["pp1 fixed"]["median_s"],
        "pp2 dynamic / pp1 fixed": ttft["pp2 dynamic"]["median_s"] / ttft["pp1 fixed"]["median_s"],
    }

    partition = args.pp_layer_partition or "even"
    print(f"tiny-moe decode, {args.streams} streams x {args.decode_tokens} tokens, pp2 layers {partition}, "
          f"median of {args.repeat} (min-max)")
    print(f"{'mode':<20} {'in flight':>9} {'tok/s':>9} {'min-max':>15} {'stage0 idle':>12} {'stage1 idle':>12}")
    for row in rows:
        idle = row["idle_fraction"]
        idle_text = (f"{idle[0]:>12.2f} {idle[1]:>12.2f}") if idle else f"{'-':>12} {'-':>12}"
        print(f"{row['mode']:<20} {row['micro_batches']:>9} {row['tok_s']:>9.0f} {row['min']:>7.0f}-{row['max']:<7.0f} {idle_text}")
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")
    print(f"  stage-to-stage round trip of a decode-sized tensor dict: {result['link_rtt_ms']:.2f} ms (median)")
    print(f"\none {args.prompt_len}-token prompt, chunk {args.chunk}: time to first token, median of {args.repeat} (min-max)")
    for name, value in ttft.items():
        print(f"{name:<20} {value['median_s']:>8.2f} s  ({value['min_s']:.2f}-{value['max_s']:.2f})")
    for name, value in ttft_ratios.items():
        print(f"  {name}: {value:.2f}x")
    print(f"  dynamic chunk sizes at prefix 0/2048/4096/6144: pp1 {result['chunkers']['pp1']}, pp2 {result['chunkers']['pp2']}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "model_dir")},
        "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
        "decode": rows, "decode_ratios": ratios, "ttft": ttft, "ttft_ratios": ttft_ratios,
        "chunkers": result["chunkers"], "link_rtt_ms": result["link_rtt_ms"], "wall_s": time.time() - started,
    }, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
