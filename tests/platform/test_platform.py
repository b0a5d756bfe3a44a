import contextvars

import pytest
import torch

from tandem.platform import CpuPlatform, get_platform


def test_default_platform_on_this_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert get_platform().name == expected
    assert get_platform("cpu") is get_platform("cpu")


def test_unknown_device_is_named():
    with pytest.raises(ValueError, match="'tpu'"):
        get_platform("tpu")


def test_cpu_events_complete_at_once_and_trace_the_protocol():
    trace = []
    platform = CpuPlatform(trace=trace)
    comm = platform.new_stream("comm")
    event = platform.new_event("done")
    event.record()
    event.wait(comm)
    assert event.query() is True
    assert event.synchronize() is None
    assert event.recorded_on is platform.default_stream
    assert trace == [("record", "done", "default"), ("wait", "done", "comm")]


def test_cpu_current_stream_is_per_context():
    platform = CpuPlatform()
    side = platform.new_stream("side")

    def in_copy():
        platform.set_stream(side)
        return platform.current_stream()

    assert contextvars.copy_context().run(in_copy) is side
    assert platform.current_stream() is platform.default_stream


def test_two_platforms_do_not_share_current_streams():
    a, b = CpuPlatform(), CpuPlatform()
    s = a.new_stream("a-only")
    ctx = contextvars.copy_context()
    ctx.run(a.set_stream, s)
    assert ctx.run(a.current_stream) is s
    assert ctx.run(b.current_stream) is b.default_stream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_event_orders_two_streams():
    platform = get_platform("cuda")
    side = platform.new_stream()
    x = torch.ones(1024, device="cuda")
    event = platform.new_event()
    with torch.cuda.stream(side):
        y = x * 2
        event.record(side)
    event.wait(platform.current_stream())
    assert torch.equal(y, torch.full_like(x, 2))
