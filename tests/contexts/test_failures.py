import threading
import time

import pytest

from tandem.contexts import (
    UBatchAborted,
    UBatchTimeoutError,
    dbo_current_ubatch_id,
    dbo_yield,
    make_executor,
    run_ubatches,
)


class Injected(RuntimeError):
    pass


def failing_at(ubatch, k, trace):
    def body():
        me = dbo_current_ubatch_id()
        try:
            for step in range(10):
                if me == ubatch and step == k:
                    raise Injected(f"fault at yield {k}")
                trace.append((me, step))
                dbo_yield()
        except UBatchAborted:
            trace.append((me, "released"))
            raise
        finally:
            trace.append((me, "finally"))

    return body


@pytest.mark.parametrize("num_ubatches", [2, 3])
@pytest.mark.parametrize("k", [0, 3])
def test_exception_at_kth_yield_surfaces_fast_and_releases_everyone(executor, num_ubatches, k):
    trace = []
    start = time.monotonic()
    with pytest.raises(Injected, match=f"fault at yield {k}") as info:
        run_ubatches([failing_at(1, k, trace)] * num_ubatches, executor=executor)
    assert time.monotonic() - start < 1.0
    assert f"raised in ubatch 1 of {num_ubatches}" in info.value.__notes__
    started = sorted({i for i, _ in trace})
    # Ubatches that had started are released at their yield; later ones never start.
    assert started == (list(range(num_ubatches)) if k > 0 else [0, 1])
    for i in started:
        assert (i, "finally") in trace
        assert i == 1 or (i, "released") in trace
    # Nobody made progress after the failure.
    failed_at = trace.index((1, "finally"))
    assert all(not isinstance(what, int) for _, what in trace[failed_at:])
    # The executor is usable again.
    assert run_ubatches([lambda: "ok"] * num_ubatches, executor=executor) == ["ok"] * num_ubatches


def test_failure_in_ubatch_0_before_any_yield(executor):
    def boom():
        raise KeyError("first")

    started = []
    with pytest.raises(KeyError) as info:
        run_ubatches([boom, lambda: started.append(1)], executor=executor)
    assert "raised in ubatch 0 of 2" in info.value.__notes__
    assert started == []  # ubatch 1 never started its body


@pytest.mark.parametrize(
    "caught, expected",
    [
        (Exception, []),  # what careless model code catches: the abort goes through
        # Model code that catches even BaseExceptions: every later yield raises again
        # instead of handing the turn to a finished ubatch.
        (BaseException, ["caught"] * 3 + ["kept going"]),
    ],
)
def test_catching_exception_does_not_swallow_the_abort(executor, caught, expected):
    trace = []

    def stubborn():
        for _ in range(3):
            try:
                dbo_yield()
            except caught:  # noqa: BLE001
                trace.append("caught")
        trace.append("kept going")

    def bad():
        raise ValueError("x")

    with pytest.raises(ValueError):
        run_ubatches([stubborn, bad], executor=executor)
    assert trace == expected
    assert run_ubatches([lambda: 1, lambda: 2], executor=executor) == [1, 2]


def test_stuck_ubatch_times_out_with_its_name_and_executor_recovers():
    executor = make_executor("thread")
    release = threading.Event()

    def stuck():
        release.wait(10)

    start = time.monotonic()
    with pytest.raises(UBatchTimeoutError, match="ubatch 0 did not hand back the turn within 0.3 s") as info:
        executor.run([stuck, dbo_yield], timeout=0.3)
    elapsed = time.monotonic() - start
    assert info.value.stuck_ubatch == 0
    assert elapsed < 3.0
    assert executor.run([lambda: 1, lambda: 2]) == [1, 2]
    release.set()
    executor.close()


def test_slow_but_progressing_run_is_not_timed_out():
    def steady():
        for _ in range(8):
            time.sleep(0.05)
            dbo_yield()
        return "done"

    # 16 handovers of 50 ms each: the whole run takes ~0.8 s, well past the 0.2 s timeout.
    assert make_executor("thread").run([steady, steady], timeout=0.2) == ["done", "done"]


def test_one_executor_refuses_two_concurrent_callers():
    executor = make_executor("thread")
    inside = threading.Event()
    leave = threading.Event()

    def hold():
        inside.set()
        leave.wait(5)

    t = threading.Thread(target=executor.run, args=([hold, lambda: None],))
    t.start()
    assert inside.wait(5)
    with pytest.raises(RuntimeError, match="already running"):
        executor.run([lambda: None, lambda: None])
    leave.set()
    t.join(5)
    executor.close()
