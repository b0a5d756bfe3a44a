"""`bench --timeline out.png`: one step of a merged overlap trace drawn as lanes, one per
rank x ubatch plus each rank's transfers (the picture of `--trace`, without a viewer)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tandem.bench.report import _pyplot
from tandem.contexts.trace import STEP_TID, TRANSFER_TID, UBATCH_TID

_UBATCH_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:cyan", "tab:olive", "tab:pink")
_KIND_COLOURS = {"recv wait": "tab:red", "collective": "tab:orange", "switch": "black"}


def pick_step(trace: dict) -> int:
    """The step to draw: among the steps of an overlapped mode (a bench tag starting with
    "dbo"), the last one of the largest token count; else the last step."""
    steps = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == STEP_TID]
    if not steps:
        raise ValueError("the trace has no steps to draw")
    overlapped = [e for e in steps if str(e["args"].get("mode", "")).startswith("dbo")] or steps
    best = max(overlapped, key=lambda e: (e["args"].get("tokens", 0), e["args"]["index"]))
    return best["args"]["index"]


def write_timeline(path: str | Path, trace: dict, *, step: int | None = None, title: str = "") -> Path:
    """Draw step `step` (default: `pick_step`) of every rank of `trace` into a PNG."""
    plt = _pyplot()
    step = pick_step(trace) if step is None else step
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    windows = {e["pid"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == STEP_TID and e["args"]["index"] == step}
    if not windows:
        raise ValueError(f"the trace has no step {step}")
    start, end = min(w[0] for w in windows.values()), max(w[1] for w in windows.values())
    inside = [e for e in events if e["pid"] in windows and e["tid"] != STEP_TID and e["ts"] < end and e["ts"] + e["dur"] > start]
    lanes = sorted({(e["pid"], e["tid"]) for e in inside}, reverse=True)  # rank 0, ubatch 0 on top
    row = {lane: i for i, lane in enumerate(lanes)}

    fig, ax = plt.subplots(figsize=(11, 0.55 * len(lanes) + 1.6), dpi=120)
    seen: set[str] = set()
    for e in inside:
        s, f = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        if e["tid"] >= TRANSFER_TID:
            ubatch = e["args"]["ubatch"]
            colour, label = _UBATCH_COLOURS[ubatch % len(_UBATCH_COLOURS)], f"transfer (ubatch {ubatch})"
            style = dict(alpha=0.45, hatch="//", edgecolor="grey")
        elif e["name"] == "compute" and (e.get("args") or {}).get("outside_ubatches"):
            colour, label, style = "silver", "step outside ubatch runs", {}
        elif e["name"] == "compute":
            ubatch = e["tid"] - UBATCH_TID
            colour, label, style = _UBATCH_COLOURS[ubatch % len(_UBATCH_COLOURS)], f"compute (ubatch {ubatch})", {}
        else:
            colour, label, style = _KIND_COLOURS.get(e["name"], "grey"), e["name"], {}
        y = row[(e["pid"], e["tid"])]
        ax.broken_barh([((s - start) / 1e3, (f - s) / 1e3)], (y - 0.38, 0.76), facecolors=colour,
                       label=None if label in seen else label, **style)
        seen.add(label)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {pid} · " + (f"ubatch {tid - UBATCH_TID}" if tid < TRANSFER_TID else
                        "transfers" if tid == TRANSFER_TID else f"transfers {tid - TRANSFER_TID + 1}")
                        for pid, tid in lanes], fontsize=8)
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("ms since the step began")
    ax.set_title("\n".join(textwrap.wrap(title or f"step {step}", 100)), fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["pick_step", "write_timeline"]
