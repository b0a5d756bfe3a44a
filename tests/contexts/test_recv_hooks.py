import pytest

from tandem.contexts import (
    dbo_current_ubatch_id,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    run_ubatches,
)


def test_hook_runs_on_the_next_ubatch_at_its_maybe_run(executor):
    trace = []

    def moe_layer():
        me = dbo_current_ubatch_id()
        dbo_maybe_run_recv_hook()
        trace.append(("send", me))
        dbo_register_recv_hook(lambda: trace.append(("recv", me, "by", dbo_current_ubatch_id())))
        dbo_yield()
        trace.append(("compute", me))
        dbo_maybe_run_recv_hook()

    run_ubatches([moe_layer, moe_layer], executor=executor)
    assert trace == [
        ("send", 0),
        ("recv", 0, "by", 1),  # ubatch 1 issues ubatch 0's receive before its own send
        ("send", 1),
        ("compute", 0),
        ("recv", 1, "by", 0),
        ("compute", 1),
    ]


def test_pending_hook_runs_when_its_ubatch_exits(executor):
    trace = []

    def first():
        dbo_register_recv_hook(lambda: trace.append("recv-of-0"))
        dbo_yield()
        trace.append("0-done")

    def second():
        trace.append("1-exits")

    run_ubatches([first, second], executor=executor)
    assert trace == ["1-exits", "recv-of-0", "0-done"]


def test_three_ubatches_park_on_their_successor(executor):
    ran_by = {}

    def body():
        me = dbo_current_ubatch_id()
        dbo_register_recv_hook(lambda: ran_by.setdefault(me, dbo_current_ubatch_id()))
        dbo_yield()
        dbo_maybe_run_recv_hook()

    run_ubatches([body] * 3, executor=executor)
    assert ran_by == {0: 1, 1: 2, 2: 0}


def test_last_alive_ubatch_keeps_its_own_hook(executor):
    trace = []

    def lonely():
        dbo_register_recv_hook(lambda: trace.append(("recv", dbo_current_ubatch_id())))
        trace.append("registered")

    run_ubatches([lambda: None, lonely], executor=executor)
    assert trace == ["registered", ("recv", 1)]


def test_failing_hook_fails_the_run(executor):
    def bad_recv():
        raise ConnectionError("peer vanished")

    def body():
        if dbo_current_ubatch_id() == 0:
            dbo_register_recv_hook(bad_recv)
        dbo_yield()
        dbo_maybe_run_recv_hook()

    with pytest.raises(ConnectionError, match="peer vanished") as info:
        run_ubatches([body, body], executor=executor)
    assert "raised in ubatch 1 of 2" in info.value.__notes__
    assert run_ubatches([lambda: 1, lambda: 2], executor=executor) == [1, 2]
