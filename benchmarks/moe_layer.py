"""A stack of MoE layers (attention stand-in + routed experts + shared experts) on N gloo
ranks: compute-only, communication-only, no overlap, DBO and SBO step times measured in
one run at one size, and DBO over the floor max(compute, communication).

    python benchmarks/moe_layer.py                                  # real gloo transport
    python benchmarks/moe_layer.py --fabric-latency-us 2000 --fabric-gbps 5
    python benchmarks/moe_layer.py --calibrate-fabric               # modelled comm ≈ compute

A thin wrapper over `tandem.bench` (the stack is `tandem.bench.moe_stack.MoEStack`, the
calibration `tandem.bench.sweep.calibrate_fabric`); `tandem bench --model moe-stack` sweeps
the same stack over token counts. Each rank runs with one intra-op thread. Times are the
slowest rank's, median of --repeat runs after --warmup runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from tandem.bench.sweep import calibrate_fabric
from tandem.bench.workloads import MoEStackWorkload
from tandem.modular_kernels import FabricModel
from tandem.testing import run_distributed

#: compute-split: the compute-only step on DBO's ubatch chunks one after the other, which
#: prices the smaller GEMMs of a split batch separately from the overlap itself.
MODES = ["compute", "compute-split", "comm", "none", "dbo", "dbo-shared@dispatch", "sbo"]


def _rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    shape = {k: cfg[k] for k in ("hidden", "intermediate", "experts", "top_k", "layers")}
    workload = MoEStackWorkload(
        rank, world, backend=cfg["backend"], num_ubatches=cfg["num_ubatches"], executor=cfg["executor"], **shape
    )
    fabric = FabricModel.from_flags(cfg["fabric_latency_us"], cfg["fabric_gbps"])
    if cfg["calibrate_fabric"]:
        fabric = calibrate_fabric(workload, cfg["tokens"])
    workload.set_fabric(fabric)
    times = {m: [] for m in MODES}
    for i in range(cfg["warmup"] + cfg["repeat"]):
        for mode in MODES:  # interleaved so every mode sees the same machine state
            t = workload.measure(mode, cfg["tokens"]).step_s * 1e3
            if i >= cfg["warmup"]:
                times[mode].append(t)
    return {"times": times, "fabric": None if fabric is None else {"latency_us": fabric.latency_us, "gbps": fabric.gbps}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="torch_a2a", choices=["torch_a2a", "torch_a2a_ll"])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-ubatches", type=int, default=2)
    parser.add_argument("--executor", default="thread", choices=["thread", "greenlet"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--fabric-latency-us", type=float)
    parser.add_argument("--fabric-gbps", type=float)
    parser.add_argument("--calibrate-fabric", action="store_true", help="model a fabric whose comm time ≈ compute time")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = {k: v for k, v in vars(args).items() if k not in ("json", "ranks")}
    result = run_distributed(_rank, args.ranks, cfg, timeout_s=1800)[0]
    med = {m: statistics.median(v) for m, v in result["times"].items()}
    spread = {m: (min(v), max(v)) for m, v in result["times"].items()}
    floor = max(med["compute"], med["comm"])
    transport = "gloo" if result["fabric"] is None else (
        f"modelled fabric: {result['fabric']['latency_us']:.0f} µs + {result['fabric']['gbps']:.3f} GB/s"
    )
    print(
        f"{args.ranks} ranks, {args.backend}, {args.tokens} tokens/rank, {args.layers} layers, "
        f"{args.num_ubatches} ubatches ({args.executor}), transport: {transport}"
    )
    print(f"{'mode':<21}{'median ms':>11}{'min':>9}{'max':>9}{'/ floor':>9}")
    for m in MODES:
        print(f"{m:<21}{med[m]:>11.2f}{spread[m][0]:>9.2f}{spread[m][1]:>9.2f}{med[m] / floor:>9.2f}")
    best = min(("dbo", "dbo-shared@dispatch"), key=med.get)
    split_floor = max(med["compute-split"], med["comm"])
    print(
        f"best DBO ({best}): {med['none'] / med[best]:.2f}x faster than no overlap, {med[best] / floor:.2f}x the floor, "
        f"{med[best] / split_floor:.2f}x max(compute-split, comm)"
    )
    out = args.json or Path(__file__).parent / "results" / (
        "moe_layer_gloo.json" if result["fabric"] is None else "moe_layer_fabric.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"mode": m, "median_ms": round(med[m], 3), "min_ms": round(spread[m][0], 3), "max_ms": round(spread[m][1], 3)} for m in MODES]
    out.write_text(json.dumps({"rows": rows, "floor_ms": round(floor, 3), "dbo_over_floor": round(med[best] / floor, 3),
                               "dbo_over_split_floor": round(med[best] / split_floor, 3),
                               "dbo_speedup": round(med["none"] / med[best], 3), "best_dbo_mode": best, "fabric": result["fabric"],
                               "config": {**cfg, "ranks": args.ranks}}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
