import threading

import pytest

from tandem.contexts import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_yield,
    make_executor,
    make_ubatch_contexts,
    run_ubatches,
)


def traced_ubatches(num_ubatches, steps, trace):
    def make(i):
        def body():
            for step in range(steps):
                trace.append((dbo_current_ubatch_id(), step))
                dbo_yield()
            trace.append((dbo_current_ubatch_id(), "end"))
            return f"ubatch{i}"

        return body

    return [make(i) for i in range(num_ubatches)]


@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_round_robin_order(executor, num_ubatches):
    trace = []
    results = run_ubatches(traced_ubatches(num_ubatches, 3, trace), executor=executor)
    assert results == [f"ubatch{i}" for i in range(num_ubatches)]
    expected = [(i, step) for step in range(3) for i in range(num_ubatches)]
    expected += [(i, "end") for i in range(num_ubatches)]
    assert trace == expected


def test_both_executors_give_identical_traces():
    traces = {}
    for kind in ("thread", "greenlet"):
        traces[kind] = []
        run_ubatches(traced_ubatches(4, 5, traces[kind]), executor=kind)
    assert traces["thread"] == traces["greenlet"]


def test_a_ubatch_that_finishes_early_is_skipped(executor):
    trace = []

    def short():
        trace.append("short")
        dbo_yield()
        trace.append("short-end")

    def long(name):
        def body():
            for step in range(3):
                trace.append((name, step))
                dbo_yield()

        return body

    run_ubatches([long("a"), short, long("c")], executor=executor)
    assert trace == [("a", 0), "short", ("c", 0), ("a", 1), "short-end", ("c", 1), ("a", 2), ("c", 2)]


def test_strictly_one_ubatch_runs_at_a_time(executor):
    inside = []
    overlaps = []

    def body():
        for _ in range(50):
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(len(inside))
            sum(range(200))  # give another thread the chance to sneak in
            inside.pop()
            dbo_yield()

    run_ubatches([body] * 3, executor=executor)
    assert overlaps == []


def test_current_ubatch_id_and_enabled_inside(executor):
    seen = run_ubatches(
        [lambda: (dbo_enabled(), dbo_current_ubatch_id()) for _ in range(3)], executor=executor
    )
    assert seen == [(True, 0), (True, 1), (True, 2)]


def test_single_ubatch_yield_returns_at_once(executor):
    assert run_ubatches([lambda: [dbo_yield(), dbo_yield(), 7][-1]], executor=executor) == [7]


def test_empty_run_returns_empty_list(executor):
    assert run_ubatches([], executor=executor) == []


def test_thread_workers_are_reused_across_runs():
    executor = make_executor("thread")
    names = []
    for _ in range(3):
        names.append(run_ubatches([threading.get_ident] * 2, executor=executor))
    assert names[0] == names[1] == names[2]
    assert len(set(names[0])) == 2
    assert threading.get_ident() not in names[0]
    assert len(executor.worker_threads) == 2
    executor.close()


def test_greenlet_executor_stays_on_the_caller_thread():
    assert run_ubatches([threading.get_ident] * 3, executor="greenlet") == [threading.get_ident()] * 3


def test_thread_contexts_entered_from_user_threads():
    contexts = make_ubatch_contexts(2)
    trace = []

    def worker(ctx):
        with ctx:
            for step in range(2):
                trace.append((ctx.id, step))
                dbo_yield()

    # Start ubatch 1's thread first: the turn order, not the start order, decides.
    threads = [threading.Thread(target=worker, args=(ctx,)) for ctx in reversed(contexts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert trace == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_nested_run_is_refused(executor):
    def nested():
        run_ubatches([lambda: None, lambda: None], executor=executor)

    with pytest.raises(RuntimeError, match="nested"):
        run_ubatches([nested, lambda: None], executor=executor)


def test_unknown_executor_is_named():
    with pytest.raises(ValueError, match="'fibers'"):
        run_ubatches([lambda: None], executor="fibers")


def test_contexts_must_match_the_executor():
    with pytest.raises(ValueError, match="executor='greenlet'"):
        run_ubatches([lambda: None] * 2, executor="greenlet", contexts=make_ubatch_contexts(2))
    with pytest.raises(ValueError, match="2 ubatch contexts for 3"):
        run_ubatches([lambda: None] * 3, contexts=make_ubatch_contexts(2))


def test_greenlet_contexts_refuse_plain_threads():
    (ctx,) = make_ubatch_contexts(1, executor="greenlet")
    with pytest.raises(RuntimeError, match="GreenletExecutor"):
        with ctx:
            pass
