"""Two builds of tandem's CPU kernels in one process: the routed experts (`cpu_kernels.moe`)
of this tree's C source against another source's, call by call in alternating order, so both
see the same machine at the same moment (a shared machine drifts more than a kernel change).

    git show HEAD~1:src/tandem/platform/csrc/cpu_kernels.c > /tmp/old_kernels.c
    python benchmarks/kernel_ab.py --before /tmp/old_kernels.c

Shapes are `tokens x hidden x intermediate x experts` (top-2, distinct experts per token).
Prints the median call of each build and their ratio (< 1: this tree is faster) and writes
JSON (benchmarks/results/kernel_ab.json unless --output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.platform import cpu_kernels, cpu_kernels_build

RESULTS = Path(__file__).resolve().parent / "results" / "kernel_ab.json"
SHAPES = "128x1024x512x16,32x1024x512x16,160x256x128x8"


def libraries(before: Path) -> dict:
    """{"before": the other source's library, "after": this tree's}, both built (or read from
    the kernel cache) by `cpu_kernels_build` itself."""
    after = cpu_kernels_build.library()
    cpu_kernels_build.library.cache_clear()
    own = cpu_kernels_build.SOURCE
    cpu_kernels_build.SOURCE = before
    try:
        before_lib = cpu_kernels_build.library()
    finally:
        cpu_kernels_build.SOURCE = own
        cpu_kernels_build.library.cache_clear()
    if after is None or before_lib is None:
        raise SystemExit("tandem's CPU kernels did not build here (no C compiler?)")
    return {"before": before_lib, "after": after}


def time_experts(libs: dict, dtype: torch.dtype, tokens: int, hidden: int, inter: int, experts: int, calls: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / 30).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / 30).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g).to(dtype)
    packed13, packed2 = cpu_kernels.pack(w13), cpu_kernels.pack(w2)
    own = cpu_kernels._library
    times: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for call in range(calls + 2):
            for name in ("before", "after") if call % 2 else ("after", "before"):
                cpu_kernels._library = lambda lib=libs[name]: lib
                start = time.perf_counter()
                cpu_kernels.moe(x, ids, weights, packed13, packed2, inter)
                if call >= 2:  # the first calls warm both builds' scratch
                    times[name].append(time.perf_counter() - start)
    finally:
        cpu_kernels._library = own
    before, after = statistics.median(times["before"]) * 1e3, statistics.median(times["after"]) * 1e3
    return {"dtype": str(dtype).removeprefix("torch."), "shape": [tokens, hidden, inter, experts],
            "before_ms": before, "after_ms": after, "ratio": after / before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other cpu_kernels.c")
    parser.add_argument("--shapes", default=SHAPES, help="tokens x hidden x intermediate x experts, comma separated")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    libs = libraries(args.before)
    rows = []
    print(f"routed experts, {torch.get_num_threads()} threads, median of {args.calls} alternating calls each")
    print("| dtype | tokens x hidden x inter x experts | before ms | after ms | after / before |\n|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for shape in args.shapes.split(","):
            row = time_experts(libs, getattr(torch, dtype), *(int(v) for v in shape.split("x")), calls=args.calls)
            rows.append(row)
            print(f"| {dtype} | {shape} | {row['before_ms']:.2f} | {row['after_ms']:.2f} | {row['ratio']:.2f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
