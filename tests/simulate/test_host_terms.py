"""The terms `--hardware here` measures beyond the roofline (#31), each pinned on a profile
whose figures are given: cold weights (every GEMM adds its weight bytes at the cold read
rate), gloo's transfers (a fixed cost per call plus bytes at a rate, per kind), and the split
loss they make (a split step reads every weight again and pays every call's fixed cost per
ubatch). The real measurements run in the slow tier."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.simulate import load_hardware, simulate
from tandem.simulate.host_elementwise import ElementwiseFit
from tandem.simulate.host_link import KINDS, LinkFit, TimedAllToAll
from tandem.simulate.host_ranks import measure_ranks
from tandem.simulate.line_fit import UNRESOLVED, fit_line
from tests.support.host_profiles import ROOFLINE, given_host

#: Float32 weight bytes one rank of the MoE stack reads a step: per layer the attention
#: stand-in (2 x 1024 x 1024), the router (1024 x 8), 4 local experts (3 x 512 x 1024 each) and
#: the shared expert (3 x 512 x 1024); 4 layers.
STACK_WEIGHT_BYTES = 4 * 4 * (2 * 2**20 + 8 * 1024 + 5 * 3 * 512 * 1024)
#: Float32 bytes one transfer of 128 tokens moves per rank: 1.5 ranks per token (top-2 of 2 ranks) x 4 KiB.
TRANSFER_BYTES = 128 * 1.5 * 4096


def _stack(hw, tokens=128):
    return simulate("moe-stack", hw, ep=2, phase="decode", tokens_per_rank=tokens, context=1,
                    modes=["none", "dbo"], low_latency=False).results


def test_a_cold_weight_adds_its_bytes_at_the_cold_rate_to_every_gemm():
    warm = given_host(small_rate=100e9, switch_s=0.0)
    cold = given_host(small_rate=100e9, switch_s=0.0, cold_rate=8e9)
    assert cold.gemm_time(32, 1024, 1024) - warm.gemm_time(32, 1024, 1024) == pytest.approx(2**22 / 8e9)
    assert cold.gemm_time(4, 1024, 512, groups=4) - warm.gemm_time(4, 1024, 512, groups=4) == pytest.approx(4 * 2**21 / 8e9)
    (none_w, dbo_w), (none_c, dbo_c) = _stack(warm), _stack(cold)
    assert STACK_WEIGHT_BYTES == 159_514_624
    assert none_c.step_s - none_w.step_s == pytest.approx(STACK_WEIGHT_BYTES / 8e9)  # 19.94 ms: each weight once
    # Split loss: each ubatch reads every weight again.
    assert (dbo_c.step_s - none_c.step_s) - (dbo_w.step_s - none_w.step_s) == pytest.approx(STACK_WEIGHT_BYTES / 8e9)


def test_a_gloo_transfer_costs_its_fixed_part_per_call_and_its_bytes_at_the_rate():
    link = LinkFit({"dispatch": 1e-3, "combine": 0.5e-3}, {"dispatch": 1e9, "combine": 2e9}, {k: [] for k in KINDS})
    free = given_host(small_rate=100e9, switch_s=0.0)
    hw = given_host(small_rate=100e9, switch_s=0.0, link=link)
    assert hw.comm_latency_s == {"dispatch": 1e-3, "combine": 0.5e-3}
    (none_f, dbo_f), (none, dbo) = _stack(free), _stack(hw)
    per_layer = 1e-3 + TRANSFER_BYTES / 1e9 + 0.5e-3 + TRANSFER_BYTES / 2e9
    assert none.comm_s == pytest.approx(4 * per_layer)  # 4 layers, one dispatch and one combine each
    # On the computing cores nothing is hidden: the step is the free one plus the transfers' time.
    assert none.step_s == pytest.approx(none_f.step_s - none_f.comm_s + 4 * per_layer)
    # Split loss: each ubatch pays each call's fixed part (the bytes are split, not repeated).
    assert dbo.comm_s - none.comm_s == pytest.approx(4 * 1.5e-3)
    assert (dbo.step_s - none.step_s) - (dbo_f.step_s - none_f.step_s) == pytest.approx(4 * 1.5e-3)


def test_the_link_fit_is_the_least_squares_line_through_the_measured_points():
    assert fit_line([(1.0, 3.0), (2.0, 5.0), (3.0, 7.0)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(0.0, 0.0), (1.0, 1.0), (2.0, 1.0)]) == pytest.approx((1 / 6, 0.5))
    fit = LinkFit.from_points({"dispatch": [(1e5, 1.1e-3), (1e6, 2e-3)], "combine": [(1e5, 0.5e-3), (1e6, 0.5e-3)]})
    assert fit.fixed_s["dispatch"] == pytest.approx(1e-3) and fit.bytes_per_s["dispatch"] == pytest.approx(1e9)
    assert fit.fixed_s["combine"] == pytest.approx(0.5e-3) and math.isinf(fit.bytes_per_s["combine"])
    # A slope <= 0 resolves no rate: priced as free, and its description says so.
    assert UNRESOLVED in fit.describe("combine") and UNRESOLVED not in fit.describe("dispatch")
    # A line through the origin's far side (a negative intercept) costs nothing fixed, never less.
    assert LinkFit.from_points({"dispatch": [(1e5, 0.05e-3), (1e6, 1e-3)]}).fixed_s["dispatch"] == 0.0
    assert "0.10 MB 1.10 ms" in fit.describe("dispatch")


def test_the_profile_names_each_measured_term_and_how_it_was_measured():
    link = LinkFit.from_points({"dispatch": [(1e5, 1.1e-3), (1e6, 2e-3)], "combine": [(1e5, 0.6e-3), (1e6, 1.5e-3)]})
    hw = given_host(small_rate=100e9, switch_s=0.0, cold_rate=8e9, link=link)
    assert hw.cold_weight_bytes_per_s == 8e9 and "given by the caller" in hw.sources["cold_weight_bytes_per_s"]
    assert hw.nvlink_bytes_per_s == pytest.approx({"dispatch": 1e9, "combine": 1e9})
    for figure in ("comm_latency_s", "nvlink_bytes_per_s"):
        assert "torch_a2a dispatch and combine between gloo ranks" in hw.sources[figure]
        assert "0.10 MB 1.10 ms" in hw.sources[figure]
    assert ROOFLINE.matmul_size == 1024


@pytest.mark.parametrize("name", ["h800", "h100", "h200", "b200"])
def test_the_gpu_profiles_have_none_of_the_host_terms(name):
    """Their GEMMs keep the HBM roofline and their transfers one latency: nothing above moves them."""
    hw = load_hardware(name)
    assert not hw.transfers_on_compute and "cold_weight_bytes_per_s" not in hw.figures
    assert hw.cold_weight_time(2**30) == 0.0 and not isinstance(hw.comm_latency_s, dict)


@pytest.mark.slow
def test_gloo_transfers_are_measured_between_two_real_ranks():
    measured = measure_ranks(2, matmul_size=0, tokens=(8, 64), repeat=2, warmup=1)
    assert (measured.ranks, measured.cold_rate, measured.cycled) == (2, 0.0, 0)  # size 0: no cold-weight matmul
    fit = measured.link
    for kind in KINDS:
        assert [b for b, _ in fit.points[kind]] == sorted(b for b, _ in fit.points[kind])
        assert len(fit.points[kind]) == 2 and all(s > 0 for _, s in fit.points[kind])
        assert fit.fixed_s[kind] >= 0 and fit.bytes_per_s[kind] > 0
        assert math.isfinite(fit.bytes_per_s[kind]) or UNRESOLVED in fit.describe(kind)
    assert math.isfinite(measured.cold_rate) or measured.cold_rate == 0.0


def test_a_rate_its_measurement_did_not_resolve_is_flagged_in_its_source_and_warned_about():
    link = LinkFit.from_points({"dispatch": [(1e5, 1.1e-3), (1e6, 2e-3)], "combine": [(1e5, 0.6e-3), (1e6, 0.5e-3)]})
    hw = given_host(small_rate=100e9, switch_s=0.0, cold_rate=8e9, link=link)
    assert "combine: 0.10 MB 0.60 ms, 1.00 MB 0.50 ms (not resolved: slope <= 0 at these points, priced as free)" \
        in hw.sources["nvlink_bytes_per_s"]
    assert "dispatch: 0.10 MB 1.10 ms, 1.00 MB 2.00 ms;" in hw.sources["nvlink_bytes_per_s"]
    script = _simulate_here()
    assert script.unresolved_figures(hw) == ["nvlink_bytes_per_s[combine]"]
    assert script.format_warnings(hw).startswith("warning: nvlink_bytes_per_s[combine] was not resolved")
    assert "combine 0.61 ms + free (not resolved)" in script.format_profile(hw)


def test_a_cold_pass_no_slower_than_the_warm_is_flagged_in_its_source(monkeypatch):
    from tandem.simulate import host

    monkeypatch.setattr(host, "cold_weight_rate", lambda size: (math.inf, 2**28))
    hw = host.host_profile(1, roofline=ROOFLINE, small_rate=100e9, switch_s=0.0, link=LinkFit.copies(1e9),
                           elementwise=ElementwiseFit.unmeasured())
    assert "not resolved: the cold pass was not slower than the warm one, priced as free" in hw.sources["cold_weight_bytes_per_s"]
    assert _simulate_here().unresolved_figures(hw) == ["cold_weight_bytes_per_s"]


def _simulate_here():
    """benchmarks/simulate_here.py as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("simulate_here", Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_here.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Backend:
    """A stand-in `torch_a2a` backend: its dispatch sends 3 rows, its calls return at once."""

    name = "stand-in"

    def prepare_async(self, hidden, topk_weights, topk_ids, **_):
        return None, lambda: SimpleNamespace(handle=(None, [2, 1], [1, 1], 3))

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        return None, lambda: "summed"


def test_the_step_times_each_dispatch_and_combine_where_it_issues_them():
    """The line's points come from calls timed inside the stack's step: each dispatch from its
    issue to its received tokens, each combine to its sum, with the rows this rank sent."""
    calls = []
    timed = TimedAllToAll(_Backend(), calls)
    tokens = timed.prepare_before_send(None, None, None, use_fp8=False)()[1]()
    assert timed.finalize_async(None, tokens, None, None)[1]() == "summed"
    assert [(kind, rows) for kind, _, rows in calls] == [("dispatch", 3), ("combine", 3)]
    assert all(seconds >= 0 for _, seconds, _ in calls) and timed.name == "stand-in"
