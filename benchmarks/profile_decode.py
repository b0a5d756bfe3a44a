"""Where a tandem decode step's milliseconds go, on one model directory, in one process.

Loads the checkpoint the way `tandem serve` does (`load_model`), prefills B sequences of
`--context` tokens over a paged KV cache, then times decode steps (B new tokens each):

- the whole step (forward + logits), median over `--steps`;
- per module, inclusive wall time from forward hooks (median over steps) (CPU is synchronous, so a hook pair brackets
  the module's work exactly), summed over layers: `layers.*.self_attn`, `layers.*.mlp`,
  `layers.*.mlp.experts`, ..., plus `compute_logits`;
- the torch profiler's self-CPU time per ATen op, and the share of the step spent outside ATen
  ops (Python, module dispatch, metadata building).

    python benchmarks/profile_decode.py build/vs_vllm_models/qwen3_moe_h1024 --batch 1,8,32

Prints tables; `--json PATH` also writes them. Compare the step time with the server's TPOT
(benchmarks/vs_vllm.py) to see how much of a token's time the serving loop adds around the model.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from tandem.models.loader import load_model
from tandem.testing.model_harness import GreedyHarness

LAYER_INDEX = re.compile(r"layers\.\d+\.")

#: The clock every figure is read with (`--clock`): wall time, or this process's CPU time,
#: which on a shared machine does not count the time other jobs hold the cores.
clock = time.perf_counter


def module_timers(model: torch.nn.Module, totals: dict[str, float]) -> list:
    """Forward hooks adding each per-layer submodule's wall time to totals[name without index]."""
    handles = []
    for name, module in model.named_modules():
        per_layer = LAYER_INDEX.search(name) and name.count(".") <= 4
        outside_layers = name.count(".") <= 1 and name not in ("", "model", "model.layers")  # embed, norm, lm_head
        if not (per_layer or outside_layers):
            continue
        key = LAYER_INDEX.sub("layers.*.", name)
        starts: list[float] = []
        handles.append(module.register_forward_pre_hook(lambda m, a, s=starts: s.append(clock())))
        handles.append(module.register_forward_hook(
            lambda m, a, o, s=starts, k=key: totals.__setitem__(k, totals[k] + clock() - s.pop())))
    return handles


def timed_logits(model, totals: dict[str, float]):
    """`model.compute_logits` (a plain linear on the weight, no module) with its time added to totals."""
    original = model.compute_logits

    def compute_logits(hidden):
        start = clock()
        out = original(hidden)
        totals["compute_logits"] += clock() - start
        return out

    return compute_logits


def profile_batch(model, batch: int, context: int, steps: int, vocab: int) -> dict:
    block_size = 16
    decodes = 1 + 3 + 3 * steps  # the prefill's token, warm-up, then timed, hooked and profiled steps
    blocks = batch * ((context + decodes) // block_size + 2)
    harness = GreedyHarness(model, num_blocks=blocks + 1, block_size=block_size)
    gen = torch.Generator().manual_seed(0)
    sequences = [{"tokens": torch.randint(2, vocab, (context,), generator=gen).tolist(), "computed": 0} for _ in range(batch)]
    prefill_logits = harness.step(sequences)
    last_rows = prefill_logits.view(batch, context, -1)[:, -1]
    for seq, token in zip(sequences, last_rows.argmax(-1).tolist()):
        seq["tokens"].append(token)  # every decode step then has one new token per sequence

    def decode() -> float:
        start = clock()
        logits = harness.step(sequences)
        next_tokens = logits.argmax(-1).tolist()
        elapsed = clock() - start
        assert len(next_tokens) == batch, f"a decode step gave {len(next_tokens)} rows for {batch} sequences"
        for seq, token in zip(sequences, next_tokens):
            seq["tokens"].append(token)
        return elapsed

    for _ in range(3):
        decode()
    step_times = [decode() for _ in range(steps)]

    # Medians per module over the steps: on a shared machine a mean soaks up other jobs' bursts.
    per_step: dict[str, list[float]] = defaultdict(list)
    hooked = []
    for _ in range(steps):
        totals: dict[str, float] = defaultdict(float)
        handles = module_timers(model, totals)
        model.compute_logits = timed_logits(model, totals)
        hooked.append(decode())
        del model.compute_logits
        for h in handles:
            h.remove()
        for k, v in totals.items():
            per_step[k].append(v)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = [decode() for _ in range(steps)]
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    aten_ms = sum(e.self_cpu_time_total for e in ops) / 1000 / steps
    step_ms = 1000 * statistics.median(step_times)
    return {
        "batch": batch,
        "context": context,
        "step_ms": step_ms,
        "ms_per_token": step_ms / batch,
        "hooked_step_ms": 1000 * statistics.median(hooked),
        "modules_ms_per_step": dict(sorted(((k, 1000 * statistics.median(v)) for k, v in per_step.items()), key=lambda kv: -kv[1])),
        "profiled_step_ms": 1000 * statistics.median(profiled),
        "aten_self_ms_per_step": aten_ms,
        "ops_ms_per_step": {e.key: e.self_cpu_time_total / 1000 / steps for e in ops[:15]},
        "op_calls_per_step": sum(e.count for e in ops) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face model directory (or a built-in model name)")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, steadier on a shared machine (with --threads 1 it is the work done)")
    args = parser.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    info = load_model(args.model, device="cpu", dtype=torch.float32)
    vocab = info.tokenizer.get_vocab_size()
    print(f"{args.model}: {sum(p.numel() for p in info.model.parameters()) / 1e6:.1f} M parameters, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock", file=sys.stderr)
    results = []
    for batch in [int(b) for b in args.batch.split(",")]:
        r = profile_batch(info.model, batch, args.context, args.steps, vocab)
        results.append(r)
        print(f"\n## batch {batch}: decode step {r['step_ms']:.1f} ms ({r['ms_per_token']:.2f} ms/token); "
              f"with hooks {r['hooked_step_ms']:.1f} ms; under the profiler {r['profiled_step_ms']:.1f} ms, "
              f"of which ATen self time {r['aten_self_ms_per_step']:.1f} ms over {r['op_calls_per_step']:.0f} op calls")
        print("\n| module (summed over layers, inclusive) | ms/step | share of step |\n|---|---|---|")
        for name, ms in r["modules_ms_per_step"].items():
            if ms >= 0.05 * r["hooked_step_ms"] / 10:
                print(f"| {name} | {ms:.2f} | {100 * ms / r['hooked_step_ms']:.0f}% |")
        print("\n| ATen op (self CPU) | ms/step | share of ATen time |\n|---|---|---|")
        for name, ms in r["ops_ms_per_step"].items():
            print(f"| {name} | {ms:.2f} | {100 * ms / r['aten_self_ms_per_step']:.0f}% |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "torch": torch.__version__, "clock": args.clock,
                                         "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
