import threading

import pytest

from tandem.contexts import (
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    make_ubatch_contexts,
    run_ubatches,
)
from tandem.contexts.ubatch_context import current_ubatch_context
from tandem.platform import CpuPlatform


def make(executor, trace):
    platform = CpuPlatform(trace=trace)
    contexts = make_ubatch_contexts(
        2,
        executor=executor,
        platform=platform,
        compute_stream=platform.new_stream("compute"),
        comm_stream=platform.new_stream("comm"),
    )
    for ctx in contexts:
        ctx.gpu_comm_done_event.name = f"comm_done{ctx.id}"
        ctx.gpu_compute_done_event.name = f"compute_done{ctx.id}"
    return platform, contexts


def test_yield_and_switch_records_on_one_stream_and_waits_on_the_other(executor):
    trace = []
    platform, contexts = make(executor, trace)

    def body():
        me = current_ubatch_context().id
        trace.append(("ubatch", me))
        dbo_yield_and_switch_from_compute_to_comm()
        trace.append(("on", platform.current_stream().name))
        dbo_yield_and_switch_from_comm_to_compute()
        trace.append(("on", platform.current_stream().name))

    run_ubatches([body, body], executor=executor, contexts=contexts)
    assert trace == [
        ("set_stream", "compute"),
        ("ubatch", 0),
        ("record", "compute_done0", "compute"),
        ("set_stream", "compute"),
        ("ubatch", 1),
        ("record", "compute_done1", "compute"),
        ("set_stream", "comm"),
        ("wait", "compute_done0", "comm"),
        ("on", "comm"),
        ("record", "comm_done0", "comm"),
        ("set_stream", "comm"),
        ("wait", "compute_done1", "comm"),
        ("on", "comm"),
        ("record", "comm_done1", "comm"),
        ("set_stream", "compute"),
        ("wait", "comm_done0", "compute"),
        ("on", "compute"),
        ("set_stream", "compute"),
        ("wait", "comm_done1", "compute"),
        ("on", "compute"),
    ]


@pytest.mark.parametrize(
    "fn, expected",
    [
        (dbo_switch_to_comm, [("set_stream", "comm")]),
        (dbo_switch_to_compute, [("set_stream", "compute")]),
        (
            dbo_switch_to_comm_sync,
            [("record", "compute_done0", "compute"), ("set_stream", "comm"), ("wait", "compute_done0", "comm")],
        ),
        (
            dbo_switch_to_compute_sync,
            [("record", "comm_done0", "comm"), ("set_stream", "compute"), ("wait", "comm_done0", "compute")],
        ),
    ],
)
def test_switches_without_yield(executor, fn, expected):
    trace = []
    _, contexts = make(executor, trace)

    def body():
        if current_ubatch_context().id == 0:
            del trace[:]
            fn()
            return list(trace)

    assert run_ubatches([body, lambda: None], executor=executor, contexts=contexts)[0] == expected


class ThreadStreamPlatform(CpuPlatform):
    """A CPU platform whose current stream is per OS thread, as CUDA's is: greenlets on
    one thread share it, so each yield must put the ubatch's stream back."""

    stream_is_thread_state = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._per_thread = threading.local()

    def current_stream(self):
        return getattr(self._per_thread, "stream", self.default_stream)

    def set_stream(self, stream) -> None:
        self._per_thread.stream = stream
        self._log("set_stream", stream.name)


@pytest.mark.parametrize("platform_type", [CpuPlatform, ThreadStreamPlatform])
def test_each_ubatch_keeps_its_own_current_stream(executor, platform_type):
    platform = platform_type()
    contexts = make_ubatch_contexts(
        2, executor=executor, platform=platform, compute_stream=platform.new_stream("compute"),
        comm_stream=platform.new_stream("comm"),
    )

    def body():
        from tandem.contexts import dbo_yield

        if current_ubatch_context().id == 0:
            dbo_switch_to_comm()
        seen = []
        for _ in range(2):
            dbo_yield()
            seen.append(platform.current_stream().name)
        return seen

    assert run_ubatches([body, body], executor=executor, contexts=contexts) == [["comm", "comm"], ["compute", "compute"]]
