"""tandem's CPU kernels against the torch paths they replace, on one rank's engine steps.

For each dtype, thread count and decode batch, one engine (`build_engine`, as `serve` builds
it, eager) prefills `batch` random 128-token prompts, then its decode steps alternate between
the kernels (`tandem.platform.cpu_kernels`: the routed experts in one call, attention read from
the paged cache in place) and the torch paths (`cpu_kernels.switched_off()`: oneDNN's packed
GEMM per expert with the torch ops between them, attention over a gathered copy of the cache
through SDPA), step by step in one process. Reported: the median step of each and their ratio
(off / on: > 1, the kernels are faster), and the step against its weight-bandwidth floor (the
weights a step reads once, over a read bandwidth measured in the same run at the same thread
count). A second table times one MoE layer's experts alone from a decode to a prefill.

    python benchmarks/cpu_kernels.py --model build/vs_vllm_models/qwen3_moe_h1024 --threads 1,2

Results go to benchmarks/results/cpu_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.platform import cpu_kernels

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_kernels.json"


def read_bandwidth_gb_s(nbytes: int = 256 << 20) -> float:
    x = torch.ones(nbytes // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model, batch: int) -> float:
    """What a decode step of `batch` requests reads at least: every parameter but the embedding
    table, of the routed experts only the share a batch is expected to touch (top-k of E at
    random: 1 - (1 - k/E)^batch)."""
    total = 0.0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "weight" and module is getattr(model.model, "embed_tokens", None):
                continue
            nbytes = p.numel() * p.element_size()
            experts = getattr(module, "num_experts", None) if name in ("w13", "w2") else None
            if experts:
                nbytes *= 1 - (1 - model.config.num_experts_per_tok / experts) ** batch
            total += nbytes
    return total


def build(model: str, dtype: str, max_batch: int, prompt_len: int, steps: int):
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.build import build_engine

    return build_engine(EngineConfig(
        model=model, device="cpu", dtype=dtype, compile="off", max_num_batched_tokens=max(2048, max_batch * prompt_len),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, overlap_schedule=False),
        cache=CacheConfig(kv_cache_tokens=max_batch * (prompt_len + 2 * steps + 16)),
    ))  # fmt: skip


def alternate(engine, batch: int, prompt_len: int, steps: int, seed: int) -> dict[bool, list[float]]:
    """Decode step times (ms) with the kernels on (True) and off (False), alternating."""
    from tandem.worker.sampling import SamplingParams

    params = SamplingParams(max_tokens=2 * steps + 3, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        engine.add_request(f"b{batch}-{seed}-{i}", torch.randint(2, 250, (prompt_len,), generator=g).tolist(), params)
    engine.step()  # the prefill
    times: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    while engine.has_work:
        on = step % 2 == 0
        if on:
            elapsed = _timed(engine.step)
        else:
            with cpu_kernels.switched_off():
                elapsed = _timed(engine.step)
        if step >= 2:  # the first of each: packing, warm-up
            times[on].append(elapsed * 1e3)
        step += 1
    engine.drain()
    return times


def experts_rows(tokens: list[int], hidden: int = 1024, intermediate: int = 512, experts: int = 16) -> list[dict]:
    """One MoE layer's routed experts alone (top-2 of `experts`, 4 layers' weights cycled so each
    call reads its weights from memory) at each token count: the fused kernel against
    `TorchExperts.apply` on the torch path."""
    from tandem.modular_kernels.experts_torch import TorchExperts
    from tandem.modular_kernels.interfaces import ExpertTokens
    from tandem.platform import cpu_gemm

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        def weights(*shape):
            return torch.nn.Parameter(torch.randn(*shape, dtype=dtype) / 32, requires_grad=False)

        layers = [(weights(experts, 2 * intermediate, hidden), weights(experts, hidden, intermediate)) for _ in range(4)]
        for count in tokens:
            x, ids, gates = torch.randn(count, hidden, dtype=dtype), torch.randint(0, experts, (count, 2)), torch.rand(count, 2)
            batch = ExpertTokens(x, None, dtype, topk_ids=ids, topk_weights=gates)

            def fused():
                for w1, w2 in layers:
                    cpu_gemm.fused_experts(x, ids, gates, w1, w2)

            def torch_path():
                with cpu_kernels.switched_off():
                    for w1, w2 in layers:
                        TorchExperts().apply(batch, w1, w2)

            with torch.inference_mode():
                on = statistics.median(_timed(fused) for _ in range(5)) * 1e3 / len(layers)
                off = statistics.median(_timed(torch_path) for _ in range(5)) * 1e3 / len(layers)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": count, "rows_per_expert": 2 * count // experts,
                         "kernel_ms": round(on, 2), "torch_ms": round(off, 2), "speedup": round(off / on, 2)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="build/vs_vllm_models/qwen3_moe_h1024")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per path and batch")
    parser.add_argument("--experts-tokens", default="32,128,512,4096", help="token counts of the experts-alone table")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("tandem's CPU kernels did not build here (no C compiler?): nothing to compare")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    print("| dtype | threads | batch | kernels ms | torch ms | torch / kernels | floor ms | kernels / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        engine = build(args.model, dtype, max(batches), args.prompt_len, args.steps)
        model = engine.runner.model
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            bandwidth = read_bandwidth_gb_s()
            alternate(engine, 2, args.prompt_len, 2, seed=99)  # first use: packing, oneDNN primitives
            for batch in batches:
                times = alternate(engine, batch, args.prompt_len, args.steps, seed=batch)
                on, off = statistics.median(times[True]), statistics.median(times[False])
                floor = weight_bytes(model, batch) / bandwidth / 1e6
                row = {"dtype": dtype, "threads": threads, "batch": batch, "kernels_ms": round(on, 2),
                       "torch_ms": round(off, 2), "speedup": round(off / on, 2), "floor_ms": round(floor, 2),
                       "over_floor": round(on / floor, 2), "read_GB_s": round(bandwidth, 1)}  # fmt: skip
                rows.append(row)
                print(f"| {dtype} | {threads} | {batch} | {row['kernels_ms']} | {row['torch_ms']} | {row['speedup']}x | "
                      f"{row['floor_ms']} | {row['over_floor']}x |", flush=True)
        engine.close()
    print(f"\nOne MoE layer's routed experts alone (hidden 1024, 16 experts x 512, top-2), {torch.get_num_threads()} threads:")
    print("| dtype | tokens | rows per expert | kernel ms | torch ms | torch / kernel |")
    print("|---|---|---|---|---|---|")
    experts = experts_rows([int(t) for t in args.experts_tokens.split(",")])
    for r in experts:
        print(f"| {r['dtype']} | {r['tokens']} | {r['rows_per_expert']} | {r['kernel_ms']} | {r['torch_ms']} | {r['speedup']}x |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"model": args.model, "rows": rows, "experts": experts}, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
