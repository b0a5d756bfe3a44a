"""A stack of MoE layers (attention stand-in + routed experts + shared experts) on N gloo
ranks: compute-only, communication-only, no overlap, DBO and SBO step times measured in
one run, and DBO over the floor max(compute, communication).

    python benchmarks/moe_layer.py                                  # real gloo transport
    python benchmarks/moe_layer.py --fabric-latency-us 2000 --fabric-gbps 5
    python benchmarks/moe_layer.py --calibrate-fabric               # modelled comm ≈ compute

Each rank runs with one intra-op thread. Times are the slowest rank's, median of --repeat
runs after --warmup runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.contexts import run_ubatches
from tandem.modular_kernels import (
    ActivationFormat,
    Experts,
    FabricModel,
    build_moe_kernel,
    expert_mlp,
    select_experts,
)
from tandem.testing import run_distributed


class NoExperts(Experts):
    """Zero-cost experts for the communication-only measurement."""

    def __init__(self, activation_format: ActivationFormat):
        self.activation_format = activation_format
        self.name = "none"

    def apply(self, tokens, w1, w2):
        return torch.zeros(tokens.hidden.shape, dtype=tokens.dtype)


class Stack:
    def __init__(self, cfg: dict, rank: int, world: int):
        g = torch.Generator().manual_seed(0)
        H, I, E = cfg["hidden"], cfg["intermediate"], cfg["experts"]
        self.cfg, self.rank, self.world = cfg, rank, world
        local = E // world
        self.layers = []
        for _ in range(cfg["layers"]):
            self.layers.append(
                dict(
                    wa=torch.randn(H, H, generator=g) * H**-0.5,
                    wb=torch.randn(H, H, generator=g) * H**-0.5,
                    router=torch.randn(H, E, generator=g) * H**-0.5,
                    w1=(torch.randn(E, 2 * I, H, generator=g) * H**-0.5)[rank * local : (rank + 1) * local].contiguous(),
                    w2=(torch.randn(E, H, I, generator=g) * I**-0.5)[rank * local : (rank + 1) * local].contiguous(),
                    sw1=torch.randn(2 * I, H, generator=g) * H**-0.5,
                    sw2=torch.randn(H, I, generator=g) * I**-0.5,
                )
            )
        self.x = torch.randn(cfg["tokens"], H, generator=torch.Generator().manual_seed(rank + 1))

    def kernel(self, layer: dict, *, comm: bool, sbo: bool, fabric: FabricModel | None, max_tokens: int,
               shared_overlap: str = "combine"):
        shared = lambda h: expert_mlp(h, layer["sw1"], layer["sw2"])  # noqa: E731
        E, K, H = self.cfg["experts"], self.cfg["top_k"], self.cfg["hidden"]
        if not comm:
            return build_moe_kernel("local", "torch", num_experts=E // self.world, top_k=K, hidden_size=H, shared_experts=shared)
        return build_moe_kernel(
            self.cfg["backend"], "torch", num_experts=E, top_k=K, hidden_size=H, shared_experts=shared,
            enable_sbo=sbo, fabric=fabric, max_tokens_per_rank=max_tokens, shared_experts_overlap=shared_overlap,
        )

    def forward(self, x, kernels, *, compute: bool, local_ids: bool):
        E_local = self.cfg["experts"] // self.world
        for layer, kernel in zip(self.layers, kernels):
            h = x + torch.tanh(x @ layer["wa"]) @ layer["wb"] if compute else x
            weights, ids = select_experts(h @ layer["router"], self.cfg["top_k"], renormalize=True)
            if local_ids:
                ids = ids % E_local
            x = x + kernel(h, layer["w1"], layer["w2"], weights, ids)
        return x

    def step(self, mode: str, fabric: FabricModel | None) -> float:
        comm = not mode.startswith("compute")
        # A ubatch's static low-latency buffers only need room for its own tokens.
        dbo = mode.startswith("dbo")
        max_tokens = -(-self.cfg["tokens"] // self.cfg["num_ubatches"]) if dbo else self.cfg["tokens"]
        shared_overlap = "dispatch" if mode == "dbo-shared@dispatch" else "combine"
        kernels = [
            self.kernel(layer, comm=comm, sbo=mode == "sbo", fabric=fabric, max_tokens=max_tokens, shared_overlap=shared_overlap)
            for layer in self.layers
        ]
        if mode == "comm":
            for k in kernels:
                k.experts = NoExperts(k.experts.activation_format)
                k.shared_experts = None
        run = lambda x: self.forward(x, kernels, compute=mode != "comm", local_ids=not comm)  # noqa: E731
        dist.barrier()
        start = time.perf_counter()
        if dbo:
            chunks = self.x.tensor_split(self.cfg["num_ubatches"])
            run_ubatches([lambda c=c: run(c) for c in chunks], executor=self.cfg["executor"])
        elif mode == "compute-split":
            for chunk in self.x.tensor_split(self.cfg["num_ubatches"]):
                run(chunk)
        else:
            run(self.x)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed) * 1e3


#: compute-split: the compute-only step on DBO's ubatch chunks one after the other, which
#: prices the smaller GEMMs of a split batch separately from the overlap itself.
MODES = ["compute", "compute-split", "comm", "none", "dbo", "dbo-shared@dispatch", "sbo"]

#: Per-transfer latency of the calibrated fabric; small, so transfers are bandwidth-bound
#: and a ubatch's transfer shrinks with its size, as on a real fabric at these sizes.
CALIBRATED_LATENCY_S = 50e-6


def calibrate_fabric(stack: "Stack") -> FabricModel:
    """A bandwidth-bound fabric on which the communication-only step takes about as long
    as the compute-only step, found by rescaling the bandwidth until they match."""
    compute_s = statistics.median(stack.step("compute", None) for _ in range(3)) / 1e3
    fixed_s = 2 * stack.cfg["layers"] * CALIBRATED_LATENCY_S
    fabric = FabricModel(latency_s=CALIBRATED_LATENCY_S, bytes_per_s=20e6)
    for _ in range(3):  # fixed point: scale the bandwidth by how far comm is from compute
        comm_s = statistics.median(stack.step("comm", fabric) for _ in range(2)) / 1e3
        scale = (comm_s - fixed_s) / (compute_s - fixed_s)
        fabric = FabricModel(latency_s=CALIBRATED_LATENCY_S, bytes_per_s=fabric.bytes_per_s * scale)
    return fabric


def _rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    stack = Stack(cfg, rank, world)
    fabric = FabricModel.from_flags(cfg["fabric_latency_us"], cfg["fabric_gbps"])
    if cfg["calibrate_fabric"]:
        fabric = calibrate_fabric(stack)
    times = {m: [] for m in MODES}
    for i in range(cfg["warmup"] + cfg["repeat"]):
        for mode in MODES:  # interleaved so every mode sees the same machine state
            t = stack.step(mode, fabric)
            if i >= cfg["warmup"]:
                times[mode].append(t)
    return {"times": times, "fabric": None if fabric is None else {"latency_us": fabric.latency_s * 1e6, "gbps": fabric.bytes_per_s / 1e9}}


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
