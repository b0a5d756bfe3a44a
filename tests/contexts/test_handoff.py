"""The yield fast path: each ubatch's turn knows its successor in the ring (relinked when a
ubatch finishes or the run aborts), times each switch once, and restores the stream only
where the platform keeps it per thread (see test_streams.py for that case and
test_failures.py for yields after an abort). These pin what that path must keep."""

import pytest

from tandem.contexts import (
    CommCounters,
    dbo_yield,
    make_executor,
    make_ubatch_contexts,
    run_ubatches,
    time_model,
)
from tandem.platform import CpuPlatform

# Yields per ubatch before it returns: ubatches finish at different points of the ring.
SCHEDULES = [[3, 3], [5, 1], [3, 0, 2, 5], [0, 0, 3], [1, 4, 1, 4], [2, 2, 2], [0]]


def reference_schedule(yields):
    """Round robin found by scanning the unfinished ubatches at every step: the order the
    ring must reproduce. Returns the trace and the number of switches (hand-overs at a
    yield plus one per finish)."""
    n = len(yields)
    done, steps, trace, switches, current = [False] * n, [0] * n, [], 0, 0

    def next_alive(i):
        return next((j % n for j in range(i + 1, i + n) if not done[j % n]), None)

    while True:
        if steps[current] < yields[current]:
            trace.append((current, steps[current]))
            steps[current] += 1
            target = next_alive(current)
            if target is None:
                continue  # alone: the yield returns at once
        else:
            trace.append((current, "end"))
            done[current] = True
            target = next_alive(current)
            if target is None:
                return trace, switches + 1
        switches += 1
        current = target


def run_schedule(executor, yields):
    trace = []

    def make(i):
        def body():
            for step in range(yields[i]):
                trace.append((i, step))
                dbo_yield()
            trace.append((i, "end"))

        return body

    run_ubatches([make(i) for i in range(len(yields))], executor=executor)
    return trace


@pytest.mark.parametrize("yields", SCHEDULES)
def test_ring_order_follows_the_unfinished_ubatches(executor, yields):
    assert run_schedule(make_executor(executor), yields) == reference_schedule(yields)[0]


@pytest.mark.parametrize("yields", SCHEDULES)
def test_switch_counters_with_the_time_model_on(executor, yields):
    runner = make_executor(executor)
    counters = CommCounters()
    with time_model(counters):
        run_schedule(runner, yields)
    assert runner.runs == 1
    assert runner.switches == reference_schedule(yields)[1]
    # Every switch but the last hand-back to the caller is timed; a switch counts no transfer.
    assert runner.switch_time_s > 0 or runner.switches == 1
    assert (counters.transfers, counters.comm_s, counters.recv_wait_s) == (0, 0.0, 0.0)
    # A second run adds to the executor's totals.
    run_schedule(runner, yields)
    assert runner.switches == 2 * reference_schedule(yields)[1]


def test_yield_restores_no_stream_where_the_stream_follows_the_context(executor):
    trace = []
    platform = CpuPlatform(trace=trace)
    contexts = make_ubatch_contexts(2, executor=executor, platform=platform)

    def body():
        for _ in range(3):
            dbo_yield()

    run_ubatches([body, body], executor=executor, contexts=contexts)
    # One set_stream per ubatch as it starts, none at the six yields.
    assert [op for op, *_ in trace] == ["set_stream", "set_stream"]
