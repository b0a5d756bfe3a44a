"""`here` prices a model's routed experts at tandem's fused CPU kernel, the one the runtime runs
them in (`simulate.host_experts`), and the MoE stack's and combine-down-gemm's blocks at the GEMM
curve, as the runtime runs those on torch's path (#31)."""

from __future__ import annotations

import math

import pytest

from tandem.simulate import HardwareProfile
from tandem.simulate.block_combine import block_compute
from tandem.simulate.host_experts import (
    EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, TOKENS, FusedExpertsFit, measure_fused_experts, row_flops, weight_bytes,
)
from tandem.simulate.kernel_trace import EXPERTS_UP
from tandem.simulate.model_shape import model_shape
from tandem.simulate.ops import Layout, OpCosts
from tandem.simulate.run import Workload
from tests.support.host_profiles import given_host

FIT = FusedExpertsFit(weight_bytes_per_s=40e9, flops_per_s=100e9)


def _costs(model: str, fit: FusedExpertsFit | None, *, decode: bool = True) -> OpCosts:
    hw = given_host(small_rate=50e9, switch_s=0.0, experts=fit)
    return OpCosts(model_shape(model), hw, Layout(ep=2, decode=decode, low_latency=False))


def test_the_line_through_the_points_gives_the_two_rates():
    fixed, per_token = 1.2e-3, 5e-5
    fit = FusedExpertsFit.from_points([(t, fixed + per_token * t) for t in TOKENS])
    assert fit.weight_bytes_per_s == pytest.approx(weight_bytes(EXPERTS, HIDDEN, INTERMEDIATE, 4) / fixed)
    assert fit.flops_per_s == pytest.approx(row_flops(TOP_K, HIDDEN, INTERMEDIATE) / per_token)


def test_a_layer_reads_its_active_experts_once_and_computes_its_rows():
    # 64 tokens x top-2 over 8 experts: 128 rows, every expert all but surely active.
    seconds = FIT.time(tokens=64, top_k=2, local_experts=8, hidden=1024, intermediate=512, element=4)
    active = 8 * (1 - (7 / 8) ** 128)
    assert seconds == pytest.approx(active * 3 * 1024 * 512 * 4 / 40e9 + 128 * 6 * 1024 * 512 / 100e9)
    # One token's two rows read 8 x (1 - (7/8)^2) = 1.875 experts' weights, not eight.
    one = FIT.time(tokens=1, top_k=2, local_experts=8, hidden=1024, intermediate=512, element=4)
    assert one == pytest.approx(8 * (1 - (7 / 8) ** 2) * 3 * 1024 * 512 * 4 / 40e9 + 2 * 6 * 1024 * 512 / 100e9)


def test_a_models_experts_take_the_fused_kernel_the_moe_stacks_the_gemm_curve():
    work = Workload("decode", 64, 256).split(1)[0]
    fused = _costs("small-moe", FIT)
    shape = model_shape("small-moe")
    assert fused.compute("experts", work) == pytest.approx(FIT.time(
        tokens=64, top_k=shape.top_k, local_experts=shape.experts // 2, hidden=shape.hidden,
        intermediate=shape.moe_intermediate, element=4))
    assert _costs("small-moe", None).compute("experts", work) == pytest.approx(fused.gemm_experts(work))
    stack = Workload("decode", 64, 1).split(1)[0]
    assert _costs("moe-stack", FIT).compute("experts", stack) == pytest.approx(_costs("moe-stack", None).compute("experts", stack))


def test_the_experts_weights_are_read_at_the_profiles_element_size():
    work = Workload("decode", 64, 256).split(1)[0]
    hw = given_host(small_rate=50e9, switch_s=0.0, experts=FIT)
    half = HardwareProfile(hw.name, {**hw.figures, "element_bytes": 2}, hw.sources)
    shape = model_shape("small-moe")
    two = OpCosts(shape, half, Layout(ep=2, decode=True, low_latency=False)).compute("experts", work)
    assert two == pytest.approx(FIT.time(tokens=64, top_k=shape.top_k, local_experts=shape.experts // 2, hidden=shape.hidden,
                                         intermediate=shape.moe_intermediate, element=2))
    assert two < _costs("small-moe", FIT).compute("experts", work)


def test_combine_down_gemm_blocks_stay_on_the_gemm_path():
    work = Workload("prefill", 512, 512).split(1)[0]
    fused = _costs("small-moe", FIT, decode=False)
    assert block_compute(fused, EXPERTS_UP, work, 8) == pytest.approx(fused.gemm_experts(work) - fused.down_projection(work))
    assert block_compute(fused, EXPERTS_UP, work, 8) != pytest.approx(fused.compute("experts", work) - fused.down_projection(work))


def test_an_unmeasured_fit_puts_no_figure_in_the_profile():
    assert FusedExpertsFit.unmeasured().figures() == {}
    assert FusedExpertsFit.from_figures(given_host(small_rate=50e9, switch_s=0.0).figures) is None


def test_the_kernel_is_measured_on_this_host():
    from tandem.platform import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("tandem's CPU kernels are not built here (no compiler)")
    fit = measure_fused_experts(repeat=2)
    assert [t for t, _ in fit.points] == list(TOKENS)
    seconds = [s for _, s in fit.points]
    assert seconds == sorted(seconds), f"more tokens took less time: {fit.points}"
    assert math.isfinite(fit.flops_per_s) and fit.flops_per_s > 0
    assert set(fit.figures()) == {"fused_experts_weight_bytes_per_s", "fused_experts_flops"}
