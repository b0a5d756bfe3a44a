"""Per-op times of DeepSeek-V3 on H800 in DeepSeek's profile, beside `tandem simulate`'s.

DeepSeek's traces (deepseek-ai/profile-data `prefill.json`, `decode.json`) are larger than the
stored copies this project can read (the snapshot keeps files under 4 MiB: both are absent).
Their per-layer breakdown is public as two charts of the SGLang team's blog (lmsys.org,
2025-05-05 "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism",
section Profile Results / Detail Breakdown: `profile-prefill.png`, `profile-decode.png`, bars
"DeepSeek Profile" and "Unit Test", ms per layer, the two micro-batches together). PUBLISHED
holds those bars as read off the PNGs; `--charts DIR` reads them again from the two files.

    python benchmarks/deepseek_profile_ops.py [--charts DIR]

Prints, per phase, each category: published µs per layer, predicted µs, error, within ±20 %.
Predicted: one MoE layer in the middle of the simulated step (DBO prefill, EP32, 16,384
tokens of 4K prompts; TBO decode, EP128, 128 requests at 4K, one MTP draft each), its ops
summed into the chart's categories.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.simulate import model_shape, simulate
from tandem.simulate.ops import OpCosts
from tandem.simulate.report import PUBLISHED as THROUGHPUT
from tandem.simulate.run import Workload, _program

#: Category order of each chart, top to bottom; the value: (DeepSeek Profile, Unit Test) ms.
PUBLISHED = {
    "prefill": {
        "Overall": (34.675, None), "Dispatch Barrier": (2.078, None), "Dispatch Core": (9.481, 7.273),
        "Combine Barrier": (2.013, None), "Combine Core": (17.273, 14.286), "MoE": (12.403, 11.104),
        "Attention Core": (5.649, None), "GEMM": (8.442, None), "Other Kernels": (5.13, None),
        "Comp Stream Bubble": (2.468, None), "Comm Stream Bubble": (3.636, None),
    },
    "decode": {
        "Overall": (1.416, None), "Dispatch": (0.173, 0.062), "Combine": (0.074, 0.078), "MoE": (0.243, 0.194),
        "Attention Core": (0.501, None), "GEMM": (0.291, None), "Other Kernels": (0.085, None),
        "Launch Overhead": (0.047, None),
    },
}  # fmt: skip
#: Gridline spacing of each chart's x axis (ms); the axis starts at 0 one spacing left of the first.
TICK_MS = {"prefill": 10.0, "decode": 0.2}
COLORS = {"deepseek": (55, 158, 76), "unit": (226, 60, 48)}
#: Categories whose model figure was taken from these charts (h800.json says which): they match
#: by construction, or nearly; the rest are predictions.
FROM_CHART = {
    "prefill": {name: "model figure from this chart" for name in (
        "Dispatch Barrier", "Dispatch Core", "Combine Barrier", "Combine Core", "Attention Core", "Other Kernels")},
    "decode": {"Launch Overhead": "model figure from this chart", "Other Kernels": "figure from the prefill chart",
               "Dispatch + Combine": "SM part from this chart's unit test; waits predicted"},
}  # fmt: skip
MIDDLE_LAYER = 30


def read_chart(path: Path, phase: str) -> dict[str, tuple[float | None, float | None]]:
    """The green (DeepSeek Profile) and red (Unit Test) bars of one chart, in ms."""
    import numpy as np
    from PIL import Image

    im = np.asarray(Image.open(path).convert("RGB")).astype(int)
    gray = (np.abs(im - 235).sum(axis=2) < 20).sum(axis=0)
    grid = [x for x in range(im.shape[1]) if gray[x] > im.shape[0] * 0.5]
    px_per_ms = (grid[1] - grid[0]) / TICK_MS[phase]
    zero = grid[0] - (grid[1] - grid[0])
    bars: dict[str, list[tuple[int, float]]] = {}
    for name, rgb in COLORS.items():
        mask = np.abs(im - np.array(rgb)).sum(axis=2) < 30
        rows = [r for r in range(im.shape[0]) if mask[r, zero - 5 :].sum() > 3]
        bands = _bands(rows)
        bars[name] = [(a, (float(np.median([np.where(mask[r])[0].max() for r in range(a + 1, b)])) + 1 - zero) / px_per_ms)
                      for a, b in bands if b - a >= 4 and min(np.where(mask[a + 1])[0]) <= zero + 2]
    names = list(PUBLISHED[phase])
    green = bars["deepseek"]
    if len(green) != len(names):
        raise ValueError(f"{path}: {len(green)} DeepSeek bars, the chart has {len(names)} categories")
    out: dict[str, tuple[float | None, float | None]] = {n: (round(v, 3), None) for n, (_, v) in zip(names, green)}
    for top, value in bars["unit"]:  # a red bar sits just above the green bar of its category
        name = names[min(range(len(green)), key=lambda i: abs(green[i][0] - top - 8))]
        out[name] = (out[name][0], round(value, 3))
    return out


def _bands(rows: list[int]) -> list[tuple[int, int]]:
    bands, start = [], None
    for i, r in enumerate(rows):
        start = r if start is None else start
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            bands.append((start, r))
            start = None
    return bands


def _window(spans, layer: int) -> tuple[float, float]:
    starts = [s.start for s in spans if s.lane == "compute" and s.step.layer == layer]
    after = [s.start for s in spans if s.lane == "compute" and s.step.layer == layer + 1]
    return min(starts), min(after)


def _busy(spans, lane: str, lo: float, hi: float) -> float:
    return sum(max(0.0, min(s.end, hi) - max(s.start, lo)) for s in spans if s.lane == lane)


def _handovers(phase: str, case: dict, kw: dict) -> int:
    """Hand-overs between ubatches in the issue order of the middle layer (each costs the host
    `ubatch_switch_s`)."""
    workload = Workload(phase, case["tokens_per_rank"], case["context"], **kw)
    order, _, _ = _program(case["mode"], model_shape("deepseek-v3"), workload, workload.split(1))
    first = next(i for i, (_, s) in enumerate(order) if s.layer == MIDDLE_LAYER)
    last = next(i for i, (_, s) in enumerate(order) if s.layer == MIDDLE_LAYER + 1)
    return sum(order[i][0] != order[i + 1][0] for i in range(first, last))


def predicted(phase: str) -> dict[str, float]:
    """The chart's categories for one MoE layer of the simulated step, ms per layer."""
    case = next(c for c in THROUGHPUT if c["phase"] == phase)
    kw = dict(draft_tokens=case.get("draft_tokens", 0), acceptance=case.get("acceptance", 0.0))
    sim = simulate("deepseek-v3", "h800", ep=case["ep"], phase=phase, tokens_per_rank=case["tokens_per_rank"],
                   context=case["context"], modes=(case["mode"],), **kw)
    result, hw = sim.results[0], sim.hardware
    works = Workload(phase, case["tokens_per_rank"], case["context"], **kw).split(2)
    share = (hw.sms - hw.comm_sms(sim.layout.low_latency)) / hw.sms
    costs = OpCosts(sim.model, hw, sim.layout, sm_share=share, overlapped=True)

    def total(*ops: str) -> float:
        return sum(costs.compute(op, w) for op in ops for w in works)

    attention = sum(costs.attention_kernel(w) for w in works)
    out = {
        "Attention Core": attention, "MoE": total("experts"),
        "GEMM": total("attn_prepare", "attn_core", "shared_experts", "gate") - attention,
        "Other Kernels": total("comm_prepare_attn", "comm_prepare_mlp", "select_experts", "output", "comm_postprocess_layer"),
    }  # fmt: skip
    lo, hi = _window(result.spans, MIDDLE_LAYER)
    out["Overall"] = hi - lo
    idle = (hi - lo) - _busy(result.spans, "compute", lo, hi)
    if phase == "prefill":
        for kind in ("dispatch", "combine"):
            wire = sum(hw.transfer_time(kind, costs.transfer_bytes(kind, w), ep=case["ep"], low_latency=False) for w in works)
            barrier = wire * hw.figures.get("normal_barrier_share", {}).get(kind, 0.0)
            out[f"{kind.title()} Core"] = sum(costs.transfer(kind, w) for w in works) - barrier
            out[f"{kind.title()} Barrier"] = barrier
        out["Comp Stream Bubble"] = idle
        out["Comm Stream Bubble"] = (hi - lo) - _busy(result.spans, "comm", lo, hi)
    else:
        switches = _handovers(phase, case, kw) * float(hw.figures.get("ubatch_switch_s", 0.0))
        kernels = sum(costs.send_kernel(k, w) for k in ("dispatch", "combine") for w in works)
        out["Dispatch + Combine"] = kernels + idle - switches  # SM time and waits on the compute stream
        out["Launch Overhead"] = switches
    return {k: v * 1e3 for k, v in out.items()}


def rows(phase: str, published: dict[str, tuple[float | None, float | None]]) -> list[tuple]:
    pub = {k: v[0] for k, v in published.items()}
    if phase == "decode":
        pub["Dispatch + Combine"] = pub.pop("Dispatch") + pub.pop("Combine")
    pred = predicted(phase)
    return [(name, pub[name] * 1e3, pred[name] * 1e3, pred[name] / pub[name] - 1.0) for name in pub]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--charts", type=Path, help="folder with profile-prefill.png and profile-decode.png")
    args = parser.parse_args(argv)
    for phase in ("prefill", "decode"):
        published = read_chart(args.charts / f"profile-{phase}.png", phase) if args.charts else PUBLISHED[phase]
        if args.charts:
            print(f"{phase} chart: " + ", ".join(f"{k} {v[0]}" + (f" (unit {v[1]})" if v[1] else "") for k, v in published.items()))
        print(f"\n{phase}: µs per layer (two micro-batches)")
        print(f"{'op':<22}{'published':>11}{'predicted':>11}{'error':>9}  within ±20 %")
        for name, pub, pred, err in rows(phase, published):
            note = f"  ({FROM_CHART[phase][name]})" if name in FROM_CHART[phase] else ""
            print(f"{name:<22}{pub:>11.0f}{pred:>11.0f}{err:>+9.1%}  {'yes' if abs(err) <= 0.2 else 'no'}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
