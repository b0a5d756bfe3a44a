"""How far apart the ranks reach each all-to-all of the MoE stack's unsplit step (#31).

The simulator's ranks are equal: every rank does the same work, so one rank's timeline is the
cluster's. On this host the ranks are not equal: each dispatch and combine is a meeting point,
the first rank there waits for the other, and the step is the slower rank's. This script puts
a size on that term. Two gloo ranks over loopback run `tandem bench`'s MoE stack (`none`: the
runtime's `torch_a2a` dispatch and combine between the layers' GEMMs) and its compute-only
step (experts local, no transfer), one intra-op thread each, interleaved; every dispatch and
combine records when its rank called it (`simulate.host_link.time_calls`, `time.perf_counter`:
one monotonic clock for both processes on one host). Per call: the arrival gap between the ranks (rank 0 minus rank 1) and
its magnitude, median over the steps; per step: the sum of the magnitudes, and the none and
compute-only steps of each rank (medians).

    python benchmarks/rank_skew.py                    # 64 and 512 tokens a rank, ~40 s on 2 cores
    python benchmarks/rank_skew.py --tokens 512 --steps 12

Prints a table per size and writes benchmarks/results/rank_skew.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "rank_skew.json"


def _rank(rank: int, world: int, tokens: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    from tandem.bench.moe_stack import MoEStack
    from tandem.simulate.host_link import time_calls

    torch.set_num_threads(1)
    calls: list[tuple[str, float, int]] = []
    arrivals: list[float] = []
    stack = MoEStack(rank, world)
    time_calls(stack, calls, arrivals)
    out = {"none_s": [], "compute_s": [], "arrivals": []}
    for i in range(warmup + steps):
        dist.barrier()
        calls.clear()
        arrivals.clear()
        start = time.perf_counter()
        stack.step("none", tokens, None)
        none_s = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        stack.step("compute", tokens, None)
        if i >= warmup:
            out["none_s"].append(none_s)
            out["compute_s"].append(time.perf_counter() - start)
            out["arrivals"].append(list(arrivals))
    return out


def measure(tokens: int, steps: int, warmup: int) -> dict:
    from tandem.testing import run_distributed

    ranks = run_distributed(_rank, 2, tokens, steps, warmup, timeout_s=600)
    gaps = [[(a - b) * 1e3 for a, b in zip(r0, r1, strict=True)] for r0, r1 in zip(ranks[0]["arrivals"], ranks[1]["arrivals"])]
    calls = len(gaps[0])
    if any(len(g) != calls for g in gaps):
        raise RuntimeError(f"the steps made different numbers of calls: {sorted({len(g) for g in gaps})}")
    return {
        "tokens": tokens,
        "steps": steps,
        "none_ms": [statistics.median(r["none_s"]) * 1e3 for r in ranks],
        "compute_ms": [statistics.median(r["compute_s"]) * 1e3 for r in ranks],
        "gap_ms": [statistics.median(g[i] for g in gaps) for i in range(calls)],
        "abs_gap_ms": [statistics.median(abs(g[i]) for g in gaps) for i in range(calls)],
        "sum_abs_gap_ms": statistics.median(sum(abs(x) for x in g) for g in gaps),
        # What `host_link.sync_wait` reports: the last rank's lateness over the mean (half the gap).
        "sync_wait_ms": statistics.median(abs(x) / 2 for g in gaps for x in g),
    }


def format_row(row: dict) -> str:
    none, compute = row["none_ms"], row["compute_ms"]
    lines = [
        f"{row['tokens']} tokens a rank, median of {row['steps']} steps: none {none[0]:.1f} / {none[1]:.1f} ms, "
        f"compute alone {compute[0]:.1f} / {compute[1]:.1f} ms (rank 0 / rank 1)",
        "  arrival gap per call, rank 0 - rank 1 (ms): " + " ".join(f"{g:+.2f}" for g in row["gap_ms"]),
        "  |gap| per call (ms):                       " + " ".join(f"{g:.2f}" for g in row["abs_gap_ms"]),
        f"  |gap| summed over the step's {len(row['gap_ms'])} calls: {row['sum_abs_gap_ms']:.1f} ms "
        f"({row['sum_abs_gap_ms'] / max(none) * 100:.1f} % of the none step); the last rank comes "
        f"{row['sync_wait_ms']:.2f} ms after the ranks' mean (median over the calls)",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,512", help="tokens a rank, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--out", default=str(RESULT), help="where to write the JSON")
    args = parser.parse_args()
    try:
        sizes = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    if not sizes or min(sizes) < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--tokens needs sizes >= 1, --steps >= 1 and --warmup >= 0")
    rows = []
    for tokens in sizes:
        rows.append(measure(tokens, args.steps, args.warmup))
        print(format_row(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
