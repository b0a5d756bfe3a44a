"""The overlap timeline: what every ubatch of every rank did when, as Chrome trace-event
JSON (opens in Perfetto, ui.perfetto.dev, or chrome://tracing).

A `Tracer` records, on one rank, timestamps the time model takes anyway:

- steps (`Tracer.step`, called by whoever owns the step: `ModelRunner`, a benchmark);
- the turns of each ubatch of a run, cut at every switch (`RunTrace`, fed by the
  executor and the handoff);
- each transfer from issue to arrival, each receive wait and each synchronous collective
  (fed by `timed_receive` / `timed_blocking` in the time model).

It is reached through the step's `CommCounters.tracer`, so with tracing off the cost is
one `is None` check per transfer, per switch and per run; nothing is allocated.

`Tracer.events()` turns the records into trace events: one process per rank (pid =
rank), a "steps" track, one track per ubatch (compute segments, receive waits, collectives,
switches) and the transfers' track(s). Compute is what is left of a ubatch's turn once
its waits are cut out; time of a step spent outside any ubatch run (planning, sampling,
the whole forward of a step that did not split) is compute on ubatch 0's track.
Overlapping transfers go to extra lanes of the transfers track, because trace viewers
need the spans of one track to nest. `merge_traces` joins the ranks' events into one file.
"""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from tandem.contexts.time_model import BLOCKED_THRESHOLD_S, current_comm_counters
from tandem.contexts.ubatch_context import current_ubatch_context

#: Track ids: the steps, then ubatch u at `UBATCH_TID + u`, transfers from `TRANSFER_TID`.
STEP_TID = 0
UBATCH_TID = 1
TRANSFER_TID = 1000
#: Default cap on records per rank, so a long `serve --trace` cannot grow without bound.
DEFAULT_MAX_RECORDS = 1_000_000


class Tracer:
    """The timeline recorder of one rank. Not thread-safe by itself: the ubatches of a run
    take turns, and one rank runs one step at a time."""

    def __init__(self, rank: int = 0, *, max_records: int = DEFAULT_MAX_RECORDS):
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self.rank = rank
        self.max_records = max_records
        #: Extra arguments attached to every step recorded from now on (e.g. the bench mode).
        self.tags: dict[str, Any] = {}
        self.steps: list[tuple[float, float, dict]] = []
        self.runs: list[tuple[float, float, list[tuple[int, float, float]]]] = []  # (begin, end, switches)
        self.waits: list[tuple[str, int, float, float]] = []  # (kind, ubatch, start, end)
        self.transfers: list[tuple[int, float, float]] = []  # (issuing ubatch, issued, arrived)
        self.records = 0
        self.dropped = 0
        # One wall-clock reading anchors this rank's perf_counter so ranks line up.
        self.origin_perf = time.perf_counter()
        self.origin_wall = time.time()

    # -- recording (called on the hot path only when tracing is on) ----------------------

    def _room(self, records: int = 1) -> bool:
        if self.records + records <= self.max_records:
            self.records += records
            return True
        self.dropped += records
        return False

    @staticmethod
    def current_ubatch() -> int:
        ctx = current_ubatch_context()
        return 0 if ctx is None else ctx.id

    def step(self, start: float, end: float, **args: Any) -> None:
        if self._room():
            self.steps.append((start, end, {**self.tags, **args}))

    def run(self, begin: float, end: float, switches: list[tuple[int, float, float]]) -> None:
        """A ubatch run from `begin` to `end`; `switches` are (ubatch resumed, handed over
        at, resumed at), in order; ubatch 0 holds the first turn."""
        if self._room(1 + len(switches)):
            self.runs.append((begin, end, switches))

    def transfer(self, issuer: int, issued: float, arrived: float, wait_start: float, wait_end: float) -> None:
        """A transfer issued by ubatch `issuer`, and its receive wait by the running ubatch."""
        if self._room(2):
            self.transfers.append((issuer, issued, arrived))
            self.waits.append(("recv wait", self.current_ubatch(), wait_start, wait_end))

    def collective(self, start: float, end: float) -> None:
        if self._room():
            self.waits.append(("collective", self.current_ubatch(), start, end))

    def turns_and_switches(self) -> tuple[list[tuple[int, float, float]], list[tuple[int, int, float, float]]]:
        """(ubatch, start, end) of every turn and (from, to, handed over, resumed) of every
        switch, from the runs."""
        turns, switches = [], []
        for begin, end, run_switches in self.runs:
            ubatch, since = 0, begin
            for to, handed, resumed in run_switches:
                turns.append((ubatch, since, handed))
                switches.append((ubatch, to, handed, resumed))
                ubatch, since = to, resumed
            turns.append((ubatch, since, end))
        return turns, switches

    # -- export --------------------------------------------------------------------------

    def events(self) -> list[dict]:
        """This rank's trace events; `ts`/`dur` in µs since this rank's origin (see
        `merge_traces` for lining ranks up)."""
        return _RankExport(self).events()

    def part(self) -> dict:
        """What one rank contributes to a merged trace (picklable, JSON-able)."""
        return {"rank": self.rank, "origin_wall": self.origin_wall, "dropped": self.dropped, "events": self.events()}


class RunTrace:
    """Collects the switches of one ubatch run (one append each) and hands the run to the
    tracer when it ends."""

    __slots__ = ("tracer", "begin", "switches")

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.switches: list[tuple[int, float, float]] = []
        self.begin = time.perf_counter()

    def switch(self, to_ubatch: int, handed_over_at: float, resumed_at: float) -> None:
        self.switches.append((to_ubatch, handed_over_at, resumed_at))

    def end(self) -> None:
        self.tracer.run(self.begin, time.perf_counter(), self.switches)


def begin_traced_run() -> RunTrace | None:
    """The recorder of a ubatch run starting now, or None when the step is not traced."""
    counters = current_comm_counters()
    tracer = None if counters is None else counters.tracer
    return None if tracer is None else RunTrace(tracer)


def _span(name: str, pid: int, tid: int, start_us: float, end_us: float, args: dict | None = None) -> dict:
    event = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(start_us, 3), "dur": round(max(end_us - start_us, 0.0), 3)}
    if args:
        event["args"] = args
    return event


def _metadata(name: str, pid: int, tid: int | None, value: Any) -> dict:
    event = {"name": name, "ph": "M", "pid": pid, "args": {"name" if name.endswith("name") else "sort_index": value}}
    if tid is not None:
        event["tid"] = tid
    return event


class _RankExport:
    def __init__(self, tracer: Tracer):
        self.t = tracer
        self.pid = tracer.rank

    def us(self, perf: float) -> float:
        return (perf - self.t.origin_perf) * 1e6

    def events(self) -> list[dict]:
        t, pid = self.t, self.pid
        out: list[dict] = []
        for index, (start, end, args) in enumerate(t.steps):
            out.append(_span(f"step {index}", pid, STEP_TID, self.us(start), self.us(end), {"index": index, **args}))
        turns, switches = t.turns_and_switches()
        ubatches = {0} | {u for u, _, _ in turns} | {u for _, u, _, _ in t.waits}
        out += self._compute_and_waits(turns, switches)
        for from_ubatch, to_ubatch, handed, resumed in switches:
            out.append(
                _span("switch", pid, UBATCH_TID + to_ubatch, self.us(handed), self.us(resumed), {"from": from_ubatch, "to": to_ubatch})
            )
        lanes = self._transfers(out)
        out.sort(key=lambda e: (e["tid"], e["ts"]))
        return self._names(sorted(ubatches), lanes) + out

    def _segments(self, turns, switches) -> list[tuple[int, float, float, bool]]:
        """(ubatch, start, end, inside a run): the turns, plus each step's time outside
        them and outside the switches between them."""
        segments = [(u, s, e, True) for u, s, e in turns]
        covered = sorted([(s, e) for _, s, e in turns] + [(s, e) for _, _, s, e in switches])
        starts = [s for s, _ in covered]
        for step_start, step_end, _ in self.t.steps:
            cursor = step_start
            first = bisect.bisect_left(starts, step_start)
            for s, e in covered[first : bisect.bisect_right(starts, step_end)]:
                if s > cursor:
                    segments.append((0, cursor, s, False))
                cursor = max(cursor, e)
            if step_end > cursor:
                segments.append((0, cursor, step_end, False))
        return sorted(segments, key=lambda x: x[1])

    def _compute_and_waits(self, turns, switches) -> list[dict]:
        """Compute segments = segments less the waits inside them; the waits that blocked
        become spans of their own."""
        pid = self.pid
        waits: dict[int, list[tuple[float, float, str]]] = {}
        for kind, ubatch, start, end in self.t.waits:
            if end - start > BLOCKED_THRESHOLD_S:
                waits.setdefault(ubatch, []).append((start, end, kind))
        for per in waits.values():
            per.sort()
        out = []
        for ubatch, start, end, in_run in self._segments(turns, switches):
            tid = UBATCH_TID + ubatch
            args = None if in_run else {"outside_ubatches": True}
            per = waits.get(ubatch, [])
            cursor = start
            for w_start, w_end, kind in per[bisect.bisect_left(per, (start,)) : bisect.bisect_left(per, (end,))]:
                w_end = min(w_end, end)
                if w_start > cursor:
                    out.append(_span("compute", pid, tid, self.us(cursor), self.us(w_start), args))
                out.append(_span(kind, pid, tid, self.us(w_start), self.us(w_end)))
                cursor = max(cursor, w_end)
            if end > cursor:
                out.append(_span("compute", pid, tid, self.us(cursor), self.us(end), args))
        return out

    def _transfers(self, out: list[dict]) -> int:
        """Add the transfers, each on the first lane free at its issue; return the lane count."""
        lane_free: list[float] = []
        for issuer, issued, arrived in sorted(self.t.transfers, key=lambda x: x[1]):
            lane = next((i for i, free in enumerate(lane_free) if free <= issued), None)
            if lane is None:
                lane = len(lane_free)
                lane_free.append(arrived)
            lane_free[lane] = arrived
            out.append(
                _span(f"transfer ub{issuer}", self.pid, TRANSFER_TID + lane, self.us(issued), self.us(arrived), {"ubatch": issuer})
            )
        return len(lane_free)

    def _names(self, ubatches: Sequence[int], lanes: int) -> list[dict]:
        pid = self.pid
        out = [_metadata("process_name", pid, None, f"rank {pid}"), _metadata("process_sort_index", pid, None, pid)]
        tracks = [(STEP_TID, "steps")] + [(UBATCH_TID + u, f"ubatch {u}") for u in ubatches]
        tracks += [(TRANSFER_TID + i, "transfers" if i == 0 else f"transfers (lane {i + 1})") for i in range(lanes)]
        for tid, name in tracks:
            out += [_metadata("thread_name", pid, tid, name), _metadata("thread_sort_index", pid, tid, tid)]
        return out


def merge_traces(parts: Iterable[dict]) -> dict:
    """One trace from the ranks' `Tracer.part()`s: each rank's times shifted by its
    wall-clock origin so the ranks share one time axis starting near 0."""
    parts = sorted(parts, key=lambda p: p["rank"])
    if not parts:
        raise ValueError("no trace parts to merge")
    first = min(p["origin_wall"] for p in parts)
    events: list[dict] = []
    for part in parts:
        shift_us = (part["origin_wall"] - first) * 1e6
        for event in part["events"]:
            if "ts" in event:
                event = {**event, "ts": round(event["ts"] + shift_us, 3)}
            events.append(event)
    dropped = {p["rank"]: p["dropped"] for p in parts if p["dropped"]}
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "tandem", "ranks": len(parts), "dropped_records": dropped},
    }


def write_trace(path: str | Path, trace: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    return path


def gather_trace(tracer: Tracer, group=None) -> dict | None:
    """Collect every rank's part on rank 0 of `group` (the default group when
    torch.distributed is initialised) and merge them; None on the other ranks."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return merge_traces([tracer.part()])
    parts = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(tracer.part(), parts, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return merge_traces(parts) if parts is not None else None


__all__ = [
    "STEP_TID",
    "TRANSFER_TID",
    "UBATCH_TID",
    "RunTrace",
    "Tracer",
    "begin_traced_run",
    "gather_trace",
    "merge_traces",
    "write_trace",
]
