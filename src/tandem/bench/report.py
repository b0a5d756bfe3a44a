"""Turning a sweep into rows, a table, JSON and a PNG plot."""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

from tandem.contexts.time_model import overlap_efficiency


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def rows_from_sweep(result: dict, phase: str, modes: list[str]) -> list[dict]:
    """One row per (mode, tokens per rank): medians over the repeats, in milliseconds.

    `step_ms`, `compute_ms`, `comm_ms`, `floor_ms` are the issue's schema (`compute_ms` and
    `comm_ms` are the floor's two halves, measured in the same run, the same for every mode
    at one size); the rest is the spread and the mode's own time model.
    """
    rows = []
    for tokens, cell in sorted(result["phases"][phase].items(), key=lambda kv: int(kv[0])):
        compute_ms = 1e3 * _median(cell["_floor"], "compute_s")
        comm_ms = 1e3 * _median(cell["_floor"], "comm_s")
        floor_ms = max(compute_ms, comm_ms)
        none_ms = 1e3 * _median(cell["none"], "step_s") if "none" in cell else None
        for mode in modes:
            records = cell[mode]
            steps = [1e3 * r["step_s"] for r in records]
            step_ms = statistics.median(steps)
            tm_comm = 1e3 * _median(records, "comm_s")
            tm_wait = 1e3 * _median(records, "recv_wait_s")
            rows.append(
                {
                    "mode": mode,
                    "tokens_per_rank": int(tokens),
                    "step_ms": round(step_ms, 4),
                    "compute_ms": round(compute_ms, 4),
                    "comm_ms": round(comm_ms, 4),
                    "floor_ms": round(floor_ms, 4),
                    "phase": phase,
                    "step_ms_min": round(min(steps), 4),
                    "step_ms_max": round(max(steps), 4),
                    "over_floor": round(step_ms / floor_ms, 4) if floor_ms > 0 else None,
                    "speedup_vs_none": round(none_ms / step_ms, 4) if none_ms else None,
                    "time_model": {
                        "compute_ms": round(1e3 * _median(records, "compute_s"), 4),
                        "recv_wait_ms": round(tm_wait, 4),
                        "comm_ms": round(tm_comm, 4),
                        "switch_ms": round(1e3 * _median(records, "switch_s"), 4),
                        "overlap_efficiency": round(overlap_efficiency(tm_comm, tm_wait), 4),
                    },
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    """Median step time with its [min, max] spread, ratio to the floor and to no overlap,
    and the time model (exposed receive wait, switch time, overlap efficiency)."""
    width = max([13] + [len(r["mode"]) + 1 for r in rows])
    header = (
        f"{'tokens':>7} {'mode':<{width}}{'step ms':>10} {'[min, max]':>19}{'/floor':>8}{'vs none':>8}"
        f"{'wait ms':>9}{'switch ms':>10}{'overlap':>8}"
    )
    lines = [header, "-" * len(header)]
    last_tokens = None
    for r in rows:
        if r["tokens_per_rank"] != last_tokens:
            last_tokens = r["tokens_per_rank"]
            lines.append(
                f"{last_tokens:>7} floor {r['floor_ms']:.2f} ms = max(compute {r['compute_ms']:.2f}, comm {r['comm_ms']:.2f})"
            )
        tm = r["time_model"]
        spread = f"[{r['step_ms_min']:.2f}, {r['step_ms_max']:.2f}]"
        vs_none = f"{r['speedup_vs_none']:.2f}x" if r["speedup_vs_none"] else "-"
        over = f"{r['over_floor']:.2f}" if r["over_floor"] else "-"
        lines.append(
            f"{'':>7} {r['mode']:<{width}}{r['step_ms']:>10.2f} {spread:>19}{over:>8}{vs_none:>8}"
            f"{tm['recv_wait_ms']:>9.2f}{tm['switch_ms']:>10.3f}{tm['overlap_efficiency']:>8.0%}"
        )
    return "\n".join(lines)


def write_json(path: str | Path, rows: list[dict], config: dict, extra: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "config": config, **(extra or {})}, indent=2) + "\n")
    return path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install 'tandem[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_available() -> None:
    """Fail early, before a long sweep, when --plot cannot be honoured."""
    _pyplot()


def write_plot(path: str | Path, rows: list[dict], title: str) -> Path:
    """Step time against tokens per rank, one line per mode, and the floor
    max(compute, communication) as a dashed black line (compute and communication dotted)."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        x = [r["tokens_per_rank"] for r in mine]
        ax.plot(x, [r["step_ms"] for r in mine], marker="o", label=mode)
        ax.fill_between(x, [r["step_ms_min"] for r in mine], [r["step_ms_max"] for r in mine], alpha=0.15)
    first = [r for r in rows if r["mode"] == modes[0]]
    x = [r["tokens_per_rank"] for r in first]
    ax.plot(x, [r["floor_ms"] for r in first], "k--", linewidth=2, label="floor = max(compute, comm)")
    ax.plot(x, [r["compute_ms"] for r in first], color="grey", linestyle=":", label="compute")
    ax.plot(x, [r["comm_ms"] for r in first], color="tab:brown", linestyle=":", label="comm")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["check_plot_available", "format_table", "rows_from_sweep", "write_json", "write_plot"]
