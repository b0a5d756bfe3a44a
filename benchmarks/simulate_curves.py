"""What each overlap mode buys DeepSeek-V3 on H800 and H200, by batch: `tandem simulate` swept
over the tokens (prefill) or requests (decode) each GPU holds, in DeepSeek's published layouts
(prefill EP32 with the normal DeepEP kernels, decode EP128 with the low-latency ones, 4K
context), with the two published figures drawn beside the curves they check.

    python benchmarks/simulate_curves.py [--hardware h800,h200] [--png PATH] [--json PATH]

Prints a table per hardware and phase (tokens/s/GPU per mode, the best mode, the speed-up of
DBO over none) and writes benchmarks/results/simulate_curves.{json,png}. A prediction, not a
measurement: docs/simulate.md says which figures of the model are checked and which are not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from tandem.simulate import simulate, validation_rows  # noqa: E402

PHASES = {
    "prefill": {"ep": 32, "sizes": (512, 1024, 2048, 4096, 8192, 16384), "modes": ("none", "dbo", "tbo", "sbo-combine-shared")},
    "decode": {"ep": 128, "sizes": (8, 16, 32, 64, 128, 256), "modes": ("none", "dbo", "tbo", "sbo-combine-shared")},
}
#: DeepSeek's decode profile verifies one MTP draft per request (60 % accepted): the published
#: decode figure is of that workload, so TBO is also swept with it (dashed), the curve the
#: published point belongs on; the other decode curves are plain one-token decode.
MTP = {"draft_tokens": 1, "acceptance": 0.6}
MTP_CURVE = "tbo, one MTP draft"


def sweep(hardware: str) -> dict[str, list[dict]]:
    curves: dict[str, list[dict]] = {}
    for phase, setting in PHASES.items():
        rows = []
        for size in setting["sizes"]:
            sim = simulate("deepseek-v3", hardware, ep=setting["ep"], phase=phase, tokens_per_rank=size,
                           modes=setting["modes"])
            rates = {r.mode: r.tokens_per_s for r in sim.results}
            if phase == "decode":
                with_mtp = simulate("deepseek-v3", hardware, ep=setting["ep"], phase=phase, tokens_per_rank=size,
                                    modes=("tbo",), **MTP)
                rates[MTP_CURVE] = with_mtp.results[0].tokens_per_s
            rows.append({"tokens_per_rank": size, "tokens_per_s_per_gpu": rates,
                         "step_ms": {r.mode: r.step_s * 1e3 for r in sim.results}})
        curves[phase] = rows
    return curves


def print_table(hardware: str, curves: dict[str, list[dict]]) -> None:
    for phase, rows in curves.items():
        print(f"\nDeepSeek-V3 on {hardware}, {phase}, EP{PHASES[phase]['ep']}: tokens/s/GPU")
        modes = PHASES[phase]["modes"]
        extra = (MTP_CURVE,) if phase == "decode" else ()
        print(f"{'per GPU':>8} " + " ".join(f"{m:>19}" for m in modes + extra) + f" {'best':>19} {'dbo/none':>9}")
        for row in rows:
            rates = row["tokens_per_s_per_gpu"]
            best = max(modes, key=rates.get)
            print(f"{row['tokens_per_rank']:>8} " + " ".join(f"{rates[m]:>19,.0f}" for m in modes + extra)
                  + f" {best:>19} {rates['dbo'] / rates['none']:>8.2f}x")


def plot(results: dict[str, dict], published: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hardware = list(results)
    fig, axes = plt.subplots(len(PHASES), len(hardware), figsize=(5.2 * len(hardware), 7.2), squeeze=False)
    for col, hw in enumerate(hardware):
        for row_index, (phase, rows) in enumerate(results[hw].items()):
            ax = axes[row_index][col]
            sizes = [r["tokens_per_rank"] for r in rows]
            for mode in PHASES[phase]["modes"]:
                ax.plot(sizes, [r["tokens_per_s_per_gpu"][mode] for r in rows], marker="o", ms=3, label=mode)
            if phase == "decode":
                ax.plot(sizes, [r["tokens_per_s_per_gpu"][MTP_CURVE] for r in rows], "--", color="tab:green",
                        label=f"{MTP_CURVE} (60 % accepted)")
            for point in published:
                if point["phase"] == phase and hw == "h800":
                    ax.plot([point["tokens_per_rank"]], [point["published"]], "k*", ms=11,
                            label=f"published ({point['mode']}, {point['note']})")
                    ax.plot([point["tokens_per_rank"]], [point["predicted"]], "kx", ms=8,
                            label=f"predicted in that setting ({point['error']:+.1%})")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{hw.upper()} {phase}, EP{PHASES[phase]['ep']}")
            ax.set_xlabel("tokens per GPU" if phase == "prefill" else "requests per GPU (4K context)")
            ax.set_ylabel("tokens/s/GPU")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("tandem simulate: DeepSeek-V3, each overlap mode by batch (a prediction)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", default="h800,h200")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "simulate_curves.json")
    parser.add_argument("--png", type=Path, default=ROOT / "benchmarks" / "results" / "simulate_curves.png")
    args = parser.parse_args()
    results = {hw: sweep(hw) for hw in args.hardware.split(",")}
    for hw, curves in results.items():
        print_table(hw, curves)
    published = [
        {"phase": row["phase"], "mode": row["mode"], "tokens_per_rank": row["tokens_per_rank"],
         "published": row["tokens_per_s"], "predicted": row["predicted"], "error": row["error"],
         "note": "one MTP draft, 60 % accepted" if row.get("draft_tokens") else "no MTP"}
        for row in validation_rows()
    ]
    print("\nvalidation (DeepSeek's settings):")
    for point in published:
        print(f"  {point['phase']:>7} {point['mode']:>4} {point['note']}: published {point['published']:,.0f}, "
              f"predicted {point['predicted']:,.0f} ({point['error']:+.1%})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": "python benchmarks/simulate_curves.py " + " ".join(sys.argv[1:]),
                                     "phases": PHASES, "curves": results, "validation": published},
                                    indent=2) + "\n")
    plot(results, published, args.png)
    print(f"\nwrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
