"""The compiled step against eager, one rank, on the engine's own steps.

For each dtype and each `--compile` setting, one engine of the model is built (`build_engine`,
as `serve` builds it); for each batch size, that many requests with random prompts are
prefilled in one step and then decoded for `--decode-steps` steps. Reported per batch: the
prefill step and the median decode step (ms), compiled against eager (ratio < 1: compiled is
faster), the decode step against its weight-bandwidth floor (weights read once per step over a
read bandwidth measured in the same run), the start-up compile time, and the graphs compiled
after start-up (must be 0: serving never recompiles). Engines of the two settings alternate,
and each figure is the median over `--repeat` rounds.

    python benchmarks/compiled_step.py --model build/vs_vllm_models/qwen3_moe_h1024 [--threads 1]
    python benchmarks/compiled_step.py --model tiny-moe --batches 1,8 --dtypes float32

Results go to benchmarks/results/compiled_step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "compiled_step.json"


def read_bandwidth_gb_s(nbytes: int = 256 << 20) -> float:
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _weight_bytes(model, batch: int) -> float:
    """What a decode step of `batch` requests reads at least: every parameter but the embedding
    table (one row each), of the routed experts only the share a batch is expected to touch
    (top-k of E at random: 1 - (1 - k/E)^batch)."""
    total = 0.0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            nbytes = p.numel() * p.element_size()
            if name == "weight" and module is getattr(model.model, "embed_tokens", None):
                continue
            experts = getattr(module, "num_experts", None) if name in ("w13", "w2") else None
            if experts:
                top_k = model.config.num_experts_per_tok
                nbytes *= 1 - (1 - top_k / experts) ** batch
            total += nbytes
    return total


def warm(engine, prompt_len: int) -> None:
    """One unmeasured batch: first-use work (weight packing, lazy kernels) stays out of the figures."""
    time_batch(engine, 2, prompt_len, 2, seed=99)


def time_batch(engine, batch: int, prompt_len: int, decode_steps: int, seed: int) -> tuple[float, float]:
    """(prefill step ms, median decode step ms) of `batch` new requests on an idle engine."""
    from tandem.worker.sampling import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        engine.add_request(f"b{batch}-{seed}-{i}", torch.randint(2, 250, (prompt_len,), generator=g).tolist(), params)
    times = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    engine.drain()
    return times[0], statistics.median(times[1:-1] or times[1:])


def build(model: str, dtype: str, compile_mode: str, max_batch: int, prompt_len: int):
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.build import build_engine

    config = EngineConfig(
        model=model, device="cpu", dtype=dtype, compile=compile_mode,
        max_num_batched_tokens=max(2048, max_batch * prompt_len),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, overlap_schedule=False), cache=CacheConfig(kv_cache_tokens=max_batch * (prompt_len + 256)),
    )  # fmt: skip
    started = time.perf_counter()
    engine = build_engine(config)
    return engine, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="build/vs_vllm_models/qwen3_moe_h1024")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (serve's ranks share the cores out among themselves unless OMP_NUM_THREADS says)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = read_bandwidth_gb_s()
    record = {"model": args.model, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "read_bandwidth_gb_s": round(bandwidth, 1), "prompt_len": args.prompt_len, "rows": []}
    print(f"{args.model}, {torch.get_num_threads()} threads, read bandwidth {bandwidth:.1f} GB/s, "
          f"prompt {args.prompt_len}, median of {args.repeat} rounds")
    print("| dtype | batch | prefill eager ms | prefill compiled ms | ratio | decode eager ms | decode compiled ms "
          "| ratio | compiled / floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        samples = {mode: {b: ([], []) for b in batches} for mode in ("off", "on")}
        startup, recompiles, floor_ms = {}, 0, None
        for round_ in range(args.repeat):
            for mode in ("off", "on"):
                engine, seconds = build(args.model, dtype, mode, max(batches), args.prompt_len)
                startup.setdefault(mode, []).append(seconds)
                runner = engine.runner
                floor_ms = {b: _weight_bytes(runner.model, b) / (bandwidth * 1e9) * 1e3 for b in batches}
                warm(engine, args.prompt_len)
                graphs = runner.compiled.graphs if runner.compiled else 0
                for batch in batches:
                    prefill, decode = time_batch(engine, batch, args.prompt_len, args.decode_steps, seed=round_)
                    samples[mode][batch][0].append(prefill)
                    samples[mode][batch][1].append(decode)
                if runner.compiled:
                    recompiles = max(recompiles, runner.compiled.graphs - graphs)
                engine.close()
        for batch in batches:
            (pe, de), (pc, dc) = ([statistics.median(v) for v in samples[m][batch]] for m in ("off", "on"))
            row = {"dtype": dtype, "batch": batch, "prefill_eager_ms": pe, "prefill_compiled_ms": pc,
                   "decode_eager_ms": de, "decode_compiled_ms": dc, "decode_floor_ms": floor_ms[batch]}
            record["rows"].append(row)
            print(f"| {dtype} | {batch} | {pe:.1f} | {pc:.1f} | {pc / pe:.2f}x | {de:.1f} | {dc:.1f} | {dc / de:.2f}x "
                  f"| {dc / floor_ms[batch]:.2f}x |")
        record.setdefault("startup_s", {})[dtype] = {m: [round(s, 1) for s in v] for m, v in startup.items()}
        record.setdefault("recompiles_after_startup", {})[dtype] = recompiles
        print(f"  {dtype}: start-up eager {statistics.median(startup['off']):.1f} s, compiled "
              f"{', '.join(f'{s:.1f}' for s in startup['on'])} s (first: cold or warm cache), "
              f"graphs compiled after start-up: {recompiles}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
