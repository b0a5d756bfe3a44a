"""The overlap timeline recorder: what a traced ubatch run records, that tracing off records
nothing, and how the ranks' parts merge into one Chrome trace."""

import json
import time

import pytest

from tandem.contexts import (
    CommCounters,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    make_executor,
    run_ubatches,
    time_model,
    timed_blocking,
    timed_receive,
)
from tandem.contexts.trace import STEP_TID, TRANSFER_TID, UBATCH_TID, Tracer, begin_traced_run, merge_traces

TRANSFER_S = 0.003


def _ubatch():
    """Two layers: issue a transfer, let the next ubatch receive it, yield."""
    for _ in range(2):
        sum(range(5000))
        dbo_register_recv_hook(timed_receive(lambda: time.sleep(TRANSFER_S)))
        dbo_yield()
        dbo_maybe_run_recv_hook()


def _traced_step(tracer: Tracer, executor) -> None:
    start = time.perf_counter()
    with time_model(CommCounters(tracer=tracer)):
        with timed_blocking():
            time.sleep(0.001)  # the step's planning collective
        run_ubatches([_ubatch, _ubatch], executor=executor)
    tracer.step(start, time.perf_counter(), mode="dbo")


def _spans(events, tid=None):
    return [e for e in events if e["ph"] == "X" and (tid is None or e["tid"] == tid)]


@pytest.mark.parametrize("kind", ["thread", "greenlet"])
def test_a_traced_run_records_each_ubatch_its_switches_waits_and_transfers(kind):
    tracer = Tracer(rank=3)
    executor = make_executor(kind)
    try:
        _traced_step(tracer, executor)
    finally:
        executor.close()
    events = tracer.events()
    assert {e["ph"] for e in events} == {"X", "M"}
    assert all(e["pid"] == 3 for e in events)
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(STEP_TID, "steps"), (UBATCH_TID, "ubatch 0"), (UBATCH_TID + 1, "ubatch 1"), (TRANSFER_TID, "transfers")} <= names

    (step,) = _spans(events, STEP_TID)
    assert step["args"] == {"index": 0, "mode": "dbo"}
    ubatch_spans = [e for e in _spans(events) if UBATCH_TID <= e["tid"] < TRANSFER_TID]
    for tid in (UBATCH_TID, UBATCH_TID + 1):
        mine = _spans(events, tid)
        assert any(e["name"] == "compute" for e in mine)
        for a, b in zip(mine, mine[1:]):  # one track's spans never overlap
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-2
    # The ubatch tracks tile the step: compute, waits and switches add up to its duration.
    assert sum(e["dur"] for e in ubatch_spans) == pytest.approx(step["dur"], abs=5.0)
    assert min(e["ts"] for e in ubatch_spans) == pytest.approx(step["ts"], abs=0.01)

    # The turn passes 5 times: 4 yields and ubatch 0 finishing; each switch goes to the other ubatch.
    switches = [e for e in ubatch_spans if e["name"] == "switch"]
    assert len(switches) == 5
    assert all(e["args"]["from"] != e["args"]["to"] and e["tid"] == UBATCH_TID + e["args"]["to"] for e in switches)
    # The planning collective ran outside the ubatches (ubatch 0's track); receives blocked.
    assert [e["tid"] for e in ubatch_spans if e["name"] == "collective"] == [UBATCH_TID]
    assert sum(e["name"] == "recv wait" for e in ubatch_spans) >= 2
    transfers = [e for e in _spans(events) if e["tid"] >= TRANSFER_TID]
    assert sorted(e["args"]["ubatch"] for e in transfers) == [0, 0, 1, 1]
    assert all(e["dur"] >= TRANSFER_S * 1e6 * 0.9 for e in transfers)


def test_tracing_off_records_nothing_and_costs_no_recorder():
    assert begin_traced_run() is None
    with time_model(CommCounters()):
        assert begin_traced_run() is None
        assert run_ubatches([_ubatch, _ubatch], executor="greenlet") == [None, None]


def test_merge_lines_ranks_up_on_one_time_axis():
    parts = []
    for rank, wall in ((1, 100.002), (0, 100.0)):
        tracer = Tracer(rank)
        tracer.origin_wall = wall
        tracer.step(tracer.origin_perf + 0.001, tracer.origin_perf + 0.002)
        parts.append(tracer.part())
    trace = merge_traces(parts)
    json.dumps(trace)  # JSON-able as is
    steps = {e["pid"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert steps[0]["ts"] == pytest.approx(1000.0)
    assert steps[1]["ts"] == pytest.approx(3000.0)  # 2 ms later origin
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert trace["otherData"]["ranks"] == 2


def test_a_full_recorder_drops_and_says_so():
    tracer = Tracer(0, max_records=2)
    for i in range(5):
        tracer.step(float(i), float(i) + 0.5)
    assert len(tracer.steps) == 2 and tracer.dropped == 3
    assert merge_traces([tracer.part()])["otherData"]["dropped_records"] == {0: 3}
    with pytest.raises(ValueError, match="max_records"):
        Tracer(0, max_records=0)
