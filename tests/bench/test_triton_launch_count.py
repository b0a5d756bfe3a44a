"""Triton launches in the kernel counts (`tandem profile`, `OpCounter`): a Triton kernel is
launched through Triton's Python launcher, which no ATen dispatch mode sees, so the counter
listens at the launcher (`tandem.platform.triton_launches`) while it is entered, and only
then. Under the Triton interpreter on CPU tensors (tiny shapes); the torch.profiler pass's
summary on synthetic `key_averages()` rows."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from tandem.bench.gpu_kernels import format_kernels, summarise_kernels  # noqa: E402
from tandem.bench.op_count import OpCounter, module_scopes, scope_kernels, step_kernels  # noqa: E402
from tandem.modular_kernels.activation import silu_and_mul_triton  # noqa: E402
from tandem.platform import triton_launches  # noqa: E402

LAUNCHES = 3


class Region(torch.nn.Module):
    """One ATen op (a mul), then the SiLU-and-mul kernel `LAUNCHES` times."""

    def forward(self, x):
        y = x * 2
        return [silu_and_mul_triton(y) for _ in range(LAUNCHES)]


def _launchers():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return {cls: cls.__dict__["run"] for cls in (JITFunction, InterpretedFunction)}


def test_a_region_counts_its_triton_launches_by_name_and_its_aten_ops_unchanged():
    x = torch.randn(2, 8)
    region = Region()
    counter = OpCounter()
    with module_scopes(counter, [("region", region)]), counter:
        outs = region(x)
    expected = F.silu(2 * x[:, :4]) * (2 * x[:, 4:])
    for out in outs:  # the kernel really ran
        torch.testing.assert_close(out, expected)
    assert scope_kernels(counter, "region") == {
        # The mul alone: the interpreter's copies to the host and back inside a launch are the launch's.
        "kernels": 1 + LAUNCHES, "aten_kernels": 1, "triton_launches": LAUNCHES,
        "triton_by_kernel": {"silu_and_mul_kernel": LAUNCHES},
    }
    assert counter.total == 1 and counter.triton_total == LAUNCHES
    assert counter.triton_by_kernel == {"silu_and_mul_kernel": LAUNCHES}
    fields = step_kernels(counter, "region", 1)
    assert fields["kernels_per_step"] == 1 + LAUNCHES and fields["triton_launches_per_decoder_layer"] == LAUNCHES
    assert fields["aten_kernels_per_decoder_layer"] == 1 and fields["triton_by_kernel"] == {"silu_and_mul_kernel": LAUNCHES}


def test_the_launchers_are_restored_after_the_count_and_a_later_launch_is_not_counted():
    before = _launchers()
    x = torch.randn(1, 4)
    counter = OpCounter()
    with counter:
        silu_and_mul_triton(x)
        assert triton_launches.wrapped() and _launchers() != before
    assert not triton_launches.wrapped() and _launchers() == before
    silu_and_mul_triton(x)
    assert counter.triton_total == 1 and counter.total == 0


def test_the_launchers_are_restored_when_the_counted_step_raises():
    before = _launchers()
    with pytest.raises(RuntimeError, match="the step failed"), OpCounter():
        silu_and_mul_triton(torch.randn(1, 4))
        raise RuntimeError("the step failed")
    assert not triton_launches.wrapped() and _launchers() == before


def test_nested_counters_both_count_and_the_outer_keeps_the_wrap():
    x = torch.randn(1, 4)
    outer, inner = OpCounter(), OpCounter()
    with outer:
        with inner:
            silu_and_mul_triton(x)
        assert triton_launches.wrapped()
        silu_and_mul_triton(x)
    assert (outer.triton_total, inner.triton_total) == (2, 1)
    assert not triton_launches.wrapped()


def test_a_launch_from_another_thread_is_not_counted():
    """As the dispatch mode sees only its own thread's ops, the counter only its thread's launches."""
    x = torch.randn(1, 4)
    counter = OpCounter()
    with counter:
        worker = threading.Thread(target=silu_and_mul_triton, args=(x,))
        worker.start()
        worker.join()
    assert counter.triton_total == 0


def _row(key, count, us, device_type=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(key=key, count=count, device_type=device_type, device_time_total=us,
                           self_device_time_total=us, cpu_time_total=5.0)


def test_the_profiler_summary_lists_device_kernels_by_time():
    cpu = torch.autograd.DeviceType.CPU
    rows = [
        _row("aten::mm", 40, 900.0, cpu),  # a CPU op: its device time is its kernels', counted below
        _row("cudaLaunchKernel", 120, 0.0, cpu),
        _row("sm90_xmma_gemm_bf16bf16", 40, 800.0),
        _row("grouped_gemm_kernel", 52, 1200.0),
        _row("_decode_split", 26, 300.0),
        _row("Memset (Device)", 2, 0.0),
        _row("grouped_gemm_kernel", 2, 100.0),  # the same name twice (another shape): merged
    ]
    summary = summarise_kernels(rows, top=2)
    assert summary["distinct_kernels"] == 4 and summary["launches"] == 40 + 54 + 26 + 2
    assert summary["device_us"] == pytest.approx(2400.0)
    assert [k["name"] for k in summary["kernels"]] == ["grouped_gemm_kernel", "sm90_xmma_gemm_bf16bf16"]
    first = summary["kernels"][0]
    assert first["count"] == 54 and first["total_us"] == 1300.0
    assert first["mean_us"] == pytest.approx(1300 / 54) and first["share"] == pytest.approx(1300 / 2400)
    table = format_kernels("decode", summary)
    assert "122 launches of 4 kernels, 2.400 ms on the device; top 2 by time" in table[1]
    assert table[-1] == "| sm90_xmma_gemm_bf16bf16 | 40 | 800.0 | 20.00 | 33.3 |"


def test_the_profiler_summary_of_no_device_events_is_empty():
    summary = summarise_kernels([_row("aten::add", 3, 0.0, torch.autograd.DeviceType.CPU)])
    assert summary == {"kernels": [], "distinct_kernels": 0, "launches": 0, "device_us": 0.0}


def test_a_failed_profiler_pass_is_one_line():
    assert format_kernels("prefill", {"error": "RuntimeError: CUPTI unavailable"}) == [
        "", "## prefill: GPU kernels (torch.profiler): not recorded (RuntimeError: CUPTI unavailable)"]
