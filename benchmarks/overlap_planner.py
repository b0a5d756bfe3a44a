"""The overlap planner and cost-aware splits against static settings, on 2 local ranks.

Table 1 (per workload): a mixed workload of decode steps of 8..512 tokens per rank and
prefills, visited in a seeded shuffled order every round; at each step every policy runs
the same batch, interleaved (its order rotated each round), so all see the same machine
state:
  none          no overlap
  dbo           DBO at every size
  static-def    DBO from the default thresholds (decode 32, prefill 512 tokens)
  static-best   DBO from the thresholds `tandem tune`'s rule picks from a none/dbo sweep
                run first in the same processes (paired ratios, 3 % margin)
  auto          `--overlap-policy auto`, learning online from nothing (no tune file), its
                exploration steps included
Workloads: `moe-stack` (hidden 512, intermediate 256) on the calibrated fabric (communication ≈ compute at 512 tokens per
rank, 50 µs latency, the link queue) and `tiny-moe` model steps on real gloo.

Table 2: cost-aware splits. `tiny-moe` DBO prefill steps on a calibrated fabric: a
skewed batch (one long request deep into its context beside many short new ones, in
both orders) and a uniform one, `--ubatch-split tokens` against `balanced-cost` (its
attention price learnt online over warm-up steps of varied shapes).

Every time is the slowest rank's; medians over the measured rounds. The default run takes
a few minutes on 2 cores; the numbers are noisy on a shared machine.

    python benchmarks/overlap_planner.py [--rounds 6] [--warmup 3] [--skip-split] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

DECODE_SIZES = [8, 16, 32, 64, 128, 256, 512]
#: (tokens per rank, tokens per request) of the prefill steps.
PREFILL_SIZES = [(256, 256), (1024, 512)]
STACK_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
#: Half the bench's moe-stack width, so a round stays short on 2 shared cores.
STACK_SHAPE = dict(hidden=512, intermediate=256)
POLICIES = ["none", "dbo", "static-def", "static-best", "auto"]


def _overlaps(best: dict[str, int]):
    from tandem.config import OverlapConfig

    return {
        "none": OverlapConfig(enable_dbo=False),
        "dbo": OverlapConfig(enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0),
        "static-def": OverlapConfig(enable_dbo=True),
        "static-best": OverlapConfig(
            enable_dbo=True, dbo_decode_token_threshold=best["decode"], dbo_prefill_token_threshold=best["prefill"]
        ),
        "auto": OverlapConfig(enable_dbo=True, overlap_policy="auto"),
    }


class _StackSteps:
    """moe-stack: every size is a 'decode' step (the stack has no KV attention)."""

    def __init__(self, rank, world):
        from tandem.bench.sweep import calibrate_fabric
        from tandem.bench.workloads import MoEStackWorkload

        self.workload = MoEStackWorkload(rank, world, backend="torch_a2a", num_ubatches=2, **STACK_SHAPE)
        self.fabric = calibrate_fabric(self.workload, 512)
        self.workload.set_fabric(self.fabric)
        self.steps = [("decode", t) for t in STACK_SIZES]

    def run(self, overlap, step):
        return self.workload.run_overlap(overlap, step[1]).step_s

    def choices(self, overlap):
        return dict(self.workload.stack._planner(overlap).stats.choices)


class _ModelSteps:
    """tiny-moe model steps (ModelRunner.execute) on real gloo."""

    def __init__(self, rank, world, context_len=128):
        from tandem.bench.workloads import ModelStepWorkload
        from tandem.config import CacheConfig, EngineConfig, ParallelConfig

        config = EngineConfig(
            model="tiny-moe", parallel=ParallelConfig(data_parallel_size=world),
            cache=CacheConfig(num_kv_blocks=6000, block_size=16), max_num_batched_tokens=1024,
        )
        self.workload = ModelStepWorkload(
            config, phase="decode", context_len=context_len, prefill_len=512, max_tokens=max(DECODE_SIZES),
            distributed=world > 1,
        )
        self.context_len = context_len
        self.prefill_blocks = [self.workload.runner.allocator.allocate(32) for _ in range(2)]
        self.steps = [("decode", t) for t in DECODE_SIZES] + [("prefill", t) for t, _ in PREFILL_SIZES]
        self.fabric = None

    def chunks(self, step):
        from tandem.worker.step_inputs import ScheduledChunk

        phase, tokens = step
        g = torch.Generator().manual_seed(tokens)
        if phase == "decode":
            ids = torch.randint(0, 200, (tokens,), generator=g).tolist()
            return [ScheduledChunk([ids[r]], self.context_len, self.workload.request_blocks[r]) for r in range(tokens)]
        per_request = dict(PREFILL_SIZES)[tokens]
        return [
            ScheduledChunk(torch.randint(0, 200, (per_request,), generator=g).tolist(), 0, self.prefill_blocks[r])
            for r in range(tokens // per_request)
        ]

    def run(self, overlap, step):
        return self.workload.run_step(overlap, self.chunks(step)).step_s

    def choices(self, overlap):
        self.workload.runner.overlap = overlap
        return dict(self.workload.runner.planner.stats.choices)


def _tune(steps, overlaps, repeat: int) -> tuple[dict[str, int], list]:
    """`tandem tune`'s rule on a none/dbo sweep of these steps: per phase, the smallest size
    from which DBO wins by the margin (median paired ratio) at every larger size."""
    from tandem import tune_sweep
    from tandem.bench.tune import choose_threshold

    ratios: dict = {}
    for _ in range(repeat):
        for step in steps.steps:
            none_s = steps.run(overlaps["none"], step)
            dbo_s = steps.run(overlaps["dbo"], step)
            ratios.setdefault(step, []).append((none_s, dbo_s))
    best, table = {}, []
    for phase in ("decode", "prefill"):
        sizes = [
            (t, statistics.median(n for n, _ in v) * 1e3, statistics.median(d for _, d in v) * 1e3,
             statistics.median(d / n for n, d in v))
            for (p, t), v in ratios.items() if p == phase
        ]
        decision = choose_threshold(phase, sizes, tune_sweep.MARGIN) if sizes else None
        best[phase] = decision.threshold if decision else best.get("decode", 0)
        table += [(phase, *row) for row in (decision.table if decision else [])]
    return best, table


def planner_on_rank(rank, world, workload_name, rounds, warmup, tune_repeat, seed):
    torch.set_num_threads(1)
    steps = _StackSteps(rank, world) if workload_name == "moe-stack" else _ModelSteps(rank, world)
    for step in steps.steps:  # warm every shape once
        steps.run(_overlaps({"decode": 0, "prefill": 0})["dbo"], step)
    best, tune_table = _tune(steps, _overlaps({"decode": 0, "prefill": 0}), tune_repeat)
    overlaps = _overlaps(best)
    times = {(step, p): [] for step in steps.steps for p in POLICIES}
    rng = random.Random(seed)  # same seed on every rank: same order
    for r in range(warmup + rounds):
        order = list(steps.steps)
        rng.shuffle(order)
        for i, step in enumerate(order):
            policies = POLICIES[i % len(POLICIES):] + POLICIES[: i % len(POLICIES)]
            for policy in policies:
                step_s = steps.run(overlaps[policy], step)
                if r >= warmup:
                    times[(step, policy)].append(step_s)
    return {
        "best_thresholds": best,
        "tune": tune_table,
        "medians_ms": {f"{p}:{t}:{policy}": statistics.median(v) * 1e3 for ((p, t), policy), v in times.items()},
        "auto_choices": steps.choices(overlaps["auto"]),
        "fabric": None if steps.fabric is None else {"latency_us": steps.fabric.latency_us, "gbps": steps.fabric.gbps},
    }


# -- table 2: splits ----------------------------------------------------------------------

SPLIT_BATCHES = {
    # (new tokens, cached tokens) per request; 768 tokens per step
    "skewed (long first)": [(512, 2048)] + [(16, 0)] * 16,
    "skewed (long last)": [(16, 0)] * 16 + [(512, 2048)],
    "uniform": [(192, 512)] * 4,
}
SPLIT_TOKENS = 768
#: Warm-up shapes (besides the measured ones) so the attention price is identifiable.
PRICE_BATCHES = [[(64, 0)] * 4, [(256, 1024)] * 2, [(384, 0)], [(128, 2048)] * 3]


def split_on_rank(rank, world, rounds, warmup):
    from tandem.bench.sweep import calibrate_fabric
    from tandem.bench.workloads import ModelStepWorkload
    from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
    from tandem.worker.step_inputs import ScheduledChunk

    torch.set_num_threads(1)
    config = EngineConfig(
        model="tiny-moe", parallel=ParallelConfig(data_parallel_size=world),
        cache=CacheConfig(num_kv_blocks=1600, block_size=16), max_num_batched_tokens=1024,
    )
    workload = ModelStepWorkload(
        config, phase="prefill", context_len=0, prefill_len=384, max_tokens=SPLIT_TOKENS, distributed=world > 1
    )
    fabric = calibrate_fabric(workload, SPLIT_TOKENS)
    workload.set_fabric(fabric)
    allocator = workload.runner.allocator
    blocks = {
        id(batch): [allocator.allocate(-(-(new + cached) // 16)) for new, cached in batch]
        for batch in [*SPLIT_BATCHES.values(), *PRICE_BATCHES]
    }

    def chunks(batch):
        g = torch.Generator().manual_seed(len(batch))
        return [
            ScheduledChunk(torch.randint(0, 200, (new,), generator=g).tolist(), cached, block_ids)
            for (new, cached), block_ids in zip(batch, blocks[id(batch)])
        ]

    split = {
        name: OverlapConfig(enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0, ubatch_split=name)
        for name in ("tokens", "balanced-cost")
    }
    none = OverlapConfig(enable_dbo=False)
    times = {(b, m): [] for b in SPLIT_BATCHES for m in ("none", *split)}
    for r in range(warmup + rounds):
        if r < warmup:
            for batch in PRICE_BATCHES:
                workload.run_step(split["balanced-cost"], chunks(batch))
        for i, (name, batch) in enumerate(SPLIT_BATCHES.items()):
            modes = [("none", none), *split.items()]
            modes = modes[(r + i) % 3:] + modes[: (r + i) % 3]
            for mode, overlap in modes:
                step_s = workload.run_step(overlap, chunks(batch)).step_s
                if r >= warmup:
                    times[(name, mode)].append(step_s)
    workload.runner.overlap = split["balanced-cost"]
    weight = workload.runner.planner.model.attention_weight
    return {
        "medians_ms": {f"{b}:{m}": statistics.median(v) * 1e3 for (b, m), v in times.items()},
        "attention_weight": weight,
        "fabric": {"latency_us": fabric.latency_us, "gbps": fabric.gbps},
    }


# -- reporting ----------------------------------------------------------------------------


def planner_table(name: str, result: dict) -> tuple[str, dict]:
    med = result["medians_ms"]
    keys = sorted({tuple(k.split(":")[:2]) for k in med}, key=lambda k: (k[0] != "decode", int(k[1])))
    lines = [
        f"{name}: best static thresholds from the tune rule: decode {result['best_thresholds']['decode']}, "
        f"prefill {result['best_thresholds']['prefill']}; auto's choices {result['auto_choices']}",
        f"{'step':>14}" + "".join(f"{p:>12}" for p in POLICIES) + f"{'auto/best':>11}{'auto/min(none,dbo)':>20}",
    ]
    totals = {p: 0.0 for p in POLICIES}
    worst = 0.0
    for phase, tokens in keys:
        row = {p: med[f"{phase}:{tokens}:{p}"] for p in POLICIES}
        for p in POLICIES:
            totals[p] += row[p]
        vs_min = row["auto"] / min(row["none"], row["dbo"])
        worst = max(worst, vs_min)
        lines.append(
            f"{phase + ' ' + tokens:>14}" + "".join(f"{row[p]:>12.2f}" for p in POLICIES)
            + f"{row['auto'] / row['static-best']:>11.3f}{vs_min:>20.3f}"
        )
    lines.append(
        f"{'sum':>14}" + "".join(f"{totals[p]:>12.2f}" for p in POLICIES)
        + f"{totals['auto'] / totals['static-best']:>11.3f}{'':>20}"
    )
    summary = {
        "auto_over_best_static": totals["auto"] / totals["static-best"],
        "auto_over_none": totals["auto"] / totals["none"],
        "auto_over_static_default": totals["auto"] / totals["static-def"],
        "worst_step_auto_over_min_none_dbo": worst,
    }
    lines.append(
        f"auto / best static {summary['auto_over_best_static']:.3f} (goal <= 1.02), worst step auto / min(none, dbo) "
        f"{worst:.3f} (goal <= 1.02), auto / none {summary['auto_over_none']:.3f}, "
        f"auto / static-def {summary['auto_over_static_default']:.3f}"
    )
    return "\n".join(lines), summary


def split_table(result: dict) -> tuple[str, dict]:
    med = result["medians_ms"]
    lines = [
        f"tiny-moe prefill DBO, calibrated fabric ({result['fabric']['latency_us']:.0f} µs + bytes / "
        f"{result['fabric']['gbps']:.3g} GB/s); learnt attention price {result['attention_weight']}",
        f"{'batch':>22}{'none':>10}{'tokens':>10}{'balanced':>10}{'balanced/tokens':>17}",
    ]
    summary = {}
    for batch in SPLIT_BATCHES:
        none, tokens, balanced = (med[f"{batch}:{m}"] for m in ("none", "tokens", "balanced-cost"))
        summary[batch] = balanced / tokens
        lines.append(f"{batch:>22}{none:>10.2f}{tokens:>10.2f}{balanced:>10.2f}{balanced / tokens:>17.3f}")
    lines.append("goal: skewed balanced/tokens <= 0.90, uniform <= 1.0 (within noise)")
    return "\n".join(lines), summary


def main() -> None:
    from tandem.distributed.launch import launch_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="Measured rounds over every step size.")
    parser.add_argument("--warmup", type=int, default=3, help="Unmeasured rounds first (auto learns throughout).")
    parser.add_argument("--tune-repeat", type=int, default=3, help="Rounds of the none/dbo sweep for static-best.")
    parser.add_argument("--workloads", default="moe-stack,tiny-moe")
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/overlap_planner.json")
    args = parser.parse_args()
    out: dict = {"args": vars(args), "machine": "shared 2-core CPU (other jobs running)", "planner": {}, "split": None}
    start = time.perf_counter()
    for name in [w for w in args.workloads.split(",") if w]:
        result = launch_ranks(planner_on_rank, 2, name, args.rounds, args.warmup, args.tune_repeat, args.seed, timeout_s=3000)[0]
        fabric = result["fabric"]
        transport = "real gloo" if fabric is None else (
            f"calibrated fabric {fabric['latency_us']:.0f} µs + bytes / {fabric['gbps']:.3g} GB/s"
        )
        text, summary = planner_table(f"{name}, 2 ranks, {transport}", result)
        print(text, flush=True)
        print(file=sys.stderr)
        out["planner"][name] = {**result, "summary": summary}
    if not args.skip_split:
        result = launch_ranks(split_on_rank, 2, args.rounds, max(args.warmup // 2, 2), timeout_s=3000)[0]
        text, summary = split_table(result)
        print(text, flush=True)
        out["split"] = {**result, "summary": summary}
    out["wall_s"] = time.perf_counter() - start
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.json} ({out['wall_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
