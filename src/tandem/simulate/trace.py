"""A simulated step as the runtime's `--trace` draws a measured one: Chrome trace-event JSON
(one process per mode, a "steps" track, one track per ubatch with its compute, the
transfers' track), and the same picture as `tandem bench --timeline` (a PNG per mode)."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.contexts.trace import STEP_TID, TRANSFER_TID, UBATCH_TID
from tandem.simulate.run import ModeResult, Simulation


def _span(name: str, pid: int, tid: int, start_s: float, end_s: float, args: dict) -> dict:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start_s * 1e6, "dur": (end_s - start_s) * 1e6, "args": args}


def mode_events(result: ModeResult, pid: int = 0) -> list[dict]:
    """Trace events of one mode's step: compute spans are named "compute" (coloured by
    ubatch in the timeline) and carry the operation and layer; transfers carry their ubatch."""
    events = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"mode {result.mode}"}},
        _span("step", pid, STEP_TID, 0.0, result.step_s, {"index": 0, "mode": result.mode, "tokens": result.tokens}),
    ]
    for s in result.spans:
        args = {"op": s.step.name, "layer": s.step.layer, "ubatch": s.ubatch}
        if s.lane == "comm":
            events.append(_span(s.step.name, pid, TRANSFER_TID, s.start, s.end, args))
        else:
            events.append(_span("compute", pid, UBATCH_TID + s.ubatch, s.start, s.end, args))
    return events


def write_trace(path: str | Path, sim: Simulation) -> Path:
    events = [e for pid, r in enumerate(sim.results) for e in mode_events(r, pid)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")
    return path


def write_timelines(path: str | Path, sim: Simulation) -> list[Path]:
    """One PNG per mode (`out.png` -> `out.none.png`, ...), drawn by `bench --timeline`'s code."""
    from tandem.bench.timeline import write_timeline

    base = Path(path)
    out = []
    for r in sim.results:
        title = f"{sim.model.name} on {sim.hardware.name}, EP{sim.layout.ep}, {sim.workload.phase}: mode {r.mode} (simulated)"
        out.append(write_timeline(base.with_suffix(f".{r.mode}.png"), {"traceEvents": mode_events(r)}, step=0, title=title))
    return out


__all__ = ["mode_events", "write_timelines", "write_trace"]
