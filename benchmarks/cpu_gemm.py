"""CPU weight GEMMs: `F.linear` / `grouped_mm` (MKL repacks the weight every call) against
weights packed once for oneDNN (`tandem.platform.cpu_gemm`), in one process, alternating.

Two tables:

- per GEMM, on a model's own weight shapes, with as many distinct weights as the model has
  layers cycled through, so each call reads its weight from memory as a real step does (one
  weight reused would sit in cache and flatter both paths);
- the whole decode step of the model (forward + logits) at each batch, packed and plain
  alternating step by step (plain: `cpu_gemm` switched off in this process only).

    python benchmarks/cpu_gemm.py build/vs_vllm_models/qwen3_moe_h1024 --batch 1,8,32

Medians of `--repeat` runs; ratios are plain / packed from the same run. `--json` writes both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.models.loader import load_model
from tandem.platform import cpu_gemm
from tandem.testing.model_harness import GreedyHarness


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _plain(enabled: bool) -> None:
    cpu_gemm._AVAILABLE = enabled


def gemm_rows(model, batches: list[int], repeat: int) -> list[dict]:
    """Each distinct dense weight shape of the model, and its experts, at each row count."""
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        if param.dim() == 2 and "embed" not in name and "norm" not in name:
            by_shape.setdefault(("dense", *param.shape), []).append(param)
        elif param.dim() == 3:
            by_shape.setdefault(("experts", *param.shape), []).append(param)
    rows = []
    for (kind, *shape), weights in sorted(by_shape.items(), key=lambda item: -item[1][0].numel()):
        for batch in batches:
            if kind == "dense":
                x, counts = torch.randn(batch, shape[-1]), None
                calls = [lambda w=w: cpu_gemm.linear(x, w) for w in weights]
                plain_calls = [lambda w=w: F.linear(x, w) for w in weights]
            else:  # one decode step's pairs spread over the experts, top-2
                experts = shape[0]
                counts = [len(range(e, 2 * batch, experts)) for e in range(experts)]
                x = torch.randn(sum(counts), shape[-1])
                offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
                calls = [lambda w=w: cpu_gemm.grouped_linear(x, w, counts) for w in weights]
                plain_calls = [lambda w=w: F.grouped_mm(x, w.transpose(1, 2), offs=offsets) for w in weights]
            with torch.inference_mode():
                packed = _median_ms(lambda: [c() for c in calls], repeat) / len(weights)
                plain = _median_ms(lambda: [c() for c in plain_calls], repeat) / len(weights)
            per_expert = weights[0][0].numel() if kind == "experts" else weights[0].numel()
            touched = sum(1 for c in counts if c) if kind == "experts" else 1
            megabytes = per_expert * touched * weights[0].element_size() / 1e6
            rows.append({"kind": kind, "shape": list(shape), "rows": batch, "weights": len(weights),
                         "plain_ms": round(plain, 3), "packed_ms": round(packed, 3),
                         "speedup": round(plain / packed, 2), "packed_GB_s": round(megabytes / packed, 2)})
    return rows


def step_rows(model, vocab: int, batches: list[int], context: int, steps: int) -> list[dict]:
    rows = []
    for batch in batches:
        block_size = 16
        blocks = batch * (-(-(context + 2 * steps + 4) // block_size)) + 1
        harness = GreedyHarness(model, num_blocks=blocks, block_size=block_size)
        g = torch.Generator().manual_seed(batch)
        sequences = [{"tokens": torch.randint(0, vocab, (context,), generator=g).tolist(), "computed": 0} for _ in range(batch)]
        harness.step(sequences)
        times: dict[bool, list[float]] = {True: [], False: []}
        for step in range(2 * steps + 2):
            packed = step % 2 == 0
            _plain(packed)
            for seq in sequences:
                seq["tokens"].append(int(torch.randint(0, vocab, (), generator=g)))
            start = time.perf_counter()
            harness.step(sequences)
            if step >= 2:  # the first of each: packing, warm-up
                times[packed].append(time.perf_counter() - start)
        _plain(True)
        packed_ms, plain_ms = (statistics.median(times[k]) * 1e3 for k in (True, False))
        rows.append({"batch": batch, "plain_ms": round(plain_ms, 2), "packed_ms": round(packed_ms, 2),
                     "speedup": round(plain_ms / packed_ms, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face model directory or a built-in model name")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per path and batch")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/cpu_gemm.json"))
    args = parser.parse_args()
    if not cpu_gemm._AVAILABLE:
        raise SystemExit("this torch build has no oneDNN: nothing to compare")
    batches = [int(b) for b in args.batch.split(",")]
    info = load_model(args.model)
    model = info.model.eval()
    vocab = model.compute_logits(torch.zeros(1, next(model.parameters()).shape[-1])).shape[-1]
    print(f"# {args.model}: torch {torch.__version__}, {torch.get_num_threads()} threads")
    gemms = gemm_rows(model, batches, args.repeat)
    print("\n| GEMM | weight | rows | distinct weights | plain ms | packed ms | plain / packed | packed GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in gemms:
        print(f"| {r['kind']} | {'x'.join(map(str, r['shape']))} | {r['rows']} | {r['weights']} | {r['plain_ms']} | "
              f"{r['packed_ms']} | {r['speedup']}x | {r['packed_GB_s']} |")
    steps = step_rows(model, vocab, batches, args.context, args.steps)
    print("\n| decode batch | plain step ms | packed step ms | plain / packed |")
    print("|---|---|---|---|")
    for r in steps:
        print(f"| {r['batch']} | {r['plain_ms']} | {r['packed_ms']} | {r['speedup']}x |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "threads": torch.get_num_threads(),
                                     "gemms": gemms, "decode_steps": steps}, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
