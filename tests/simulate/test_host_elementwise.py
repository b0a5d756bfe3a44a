"""The non-GEMM work `--hardware here` prices for the MoE stack (#31): counted from the
stack's own operations (`simulate.host_elementwise.stack_layer_work`), priced on the host's
measured lines (a fixed cost per op plus its bytes, or tokens for routing, at a rate). Each
count and each price is pinned by hand; the real measurement runs in the slow tier."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.simulate import load_hardware, simulate
from tandem.simulate.host_elementwise import (
    ElementwiseFit,
    Work,
    measure_elementwise,
    stack_layer_work,
)
from tandem.simulate.line_fit import UNRESOLVED
from tests.support.host_profiles import given_host

H, I = 1024, 512  # the stack's hidden and intermediate sizes
F32 = 4


def test_the_stack_layers_elementwise_ops_are_counted_from_its_own_operations():
    T = 32
    work = stack_layer_work(T, 2)
    add = 3 * T * H * F32  # two [T, H] read, one written
    # The residual adds (the previous layer's, the attention's) and routed + shared.
    for name in ("comm_prepare_attn", "comm_prepare_mlp", "output"):
        assert work[name] == Work({"plain": 1}, {"plain": add})
    assert work["attn_prepare"] == Work({"transcendental": 1}, {"transcendental": 2 * T * H * F32})  # tanh
    # The shared expert's silu(gate) over [T, I] (a half of [T, 2I]) and its product with up.
    assert work["shared_experts"] == Work({"transcendental": 1, "plain": 1},
                                          {"transcendental": 2 * T * I * F32, "plain": 3 * T * I * F32})
    # The routed experts on 2T (token, slot) pairs: silu and mul over [2T, I], the gather of the
    # pairs' rows, the zeroed [2T, H] per-pair buffer, its index_copy_ and the weighted sum
    # (bmm), besides a few small integer ops (the sort by expert, bincount, masks).
    experts = work["experts"]
    pairs = 2 * T
    assert experts.units["transcendental"] == 2 * pairs * I * F32 and experts.ops["transcendental"] == 1
    large = (3 * pairs * I * F32  # mul
             + T * H * F32 + pairs * 8 + pairs * H * F32  # x[pair // top_k]: x, the index, the rows
             + pairs * H * F32  # new_zeros: what it writes
             + 2 * pairs * H * F32 + pairs * 8  # index_copy_: the buffer (in place, once), index, rows
             + T * 2 * F32 + pairs * H * F32 + T * H * F32)  # bmm: weights, per-pair rows, output
    assert 0 < experts.units["plain"] - large < 10_000 and experts.ops["plain"] == 16
    assert work["select_experts"] == Work({"routing": 1}, {"routing": T})
    # GEMMs are the GEMM curve's (not counted); the transfers are gloo's line's.
    assert set(work) == {"comm_prepare_attn", "attn_prepare", "comm_prepare_mlp", "experts", "shared_experts",
                         "output", "select_experts"}


def _fit(plain=(0.0, math.inf), transcendental=(0.0, math.inf), routing=(0.0, math.inf)):
    kinds = {"plain": plain, "transcendental": transcendental, "routing": routing}
    return ElementwiseFit({k: v[0] for k, v in kinds.items()}, {k: v[1] for k, v in kinds.items()}, {k: [] for k in kinds})


def _stack(hw, tokens=128):
    return simulate("moe-stack", hw, ep=2, phase="decode", tokens_per_rank=tokens, context=1,
                    modes=["none", "dbo"], low_latency=False).results


def test_a_transcendental_op_costs_its_fixed_part_and_its_bytes_at_the_measured_rate():
    free = given_host(small_rate=100e9, switch_s=0.0, elementwise=_fit())
    hw = given_host(small_rate=100e9, switch_s=0.0, elementwise=_fit(transcendental=(20e-6, 5e9)))
    (none_f, dbo_f), (none, dbo) = _stack(free), _stack(hw)
    # Per layer at 128 tokens: tanh over [128, H], silu over the experts' [256, I] and the shared [128, I].
    per_layer = 3 * 20e-6 + (2 * 128 * H + 2 * 256 * I + 2 * 128 * I) * F32 / 5e9  # 584.288 us
    assert none.step_s - none_f.step_s == pytest.approx(4 * per_layer)
    # Split into two ubatches: the bytes split, each ubatch pays each op's fixed part.
    assert (dbo.step_s - none.step_s) - (dbo_f.step_s - none_f.step_s) == pytest.approx(4 * 3 * 20e-6)


def test_routing_costs_a_call_and_its_tokens_at_the_measured_rate():
    free = given_host(small_rate=100e9, switch_s=0.0, elementwise=_fit())
    hw = given_host(small_rate=100e9, switch_s=0.0, elementwise=_fit(routing=(50e-6, 1e6)))
    (none_f, dbo_f), (none, dbo) = _stack(free, 512), _stack(hw, 512)
    assert none.step_s - none_f.step_s == pytest.approx(4 * (50e-6 + 512 / 1e6))
    assert dbo.step_s - dbo_f.step_s == pytest.approx(4 * 2 * (50e-6 + 256 / 1e6))


def test_the_measured_lines_replace_the_norm_passes():
    """With lines that cost nothing the non-GEMM work is free; without lines (GPU profiles, a host
    not measured) the norm passes at the sum's bandwidth price it as before."""
    untraced, free = given_host(small_rate=100e9, switch_s=0.0), given_host(small_rate=100e9, switch_s=0.0, elementwise=_fit())
    assert "elementwise_op_s" not in untraced.figures and ElementwiseFit.from_figures(untraced.figures) is None
    none_u, none_f = _stack(untraced)[0], _stack(free)[0]
    # 11 hidden-sized BF16 passes a layer, the router's logits twice in float32, the experts'
    # [T k, 2 I] BF16 twice; 4 layers at 20 GB/s; the head's norm, which adds the last layer's
    # residual (G9: 4 passes), once.
    passes = 4 * (11 * 128 * H * 2 + 128 * 8 * 4 * 2 + 128 * 2 * 2 * I * 2 * 2) + 4 * 128 * H * 2
    assert none_u.step_s - none_f.step_s == pytest.approx(passes / 20e9)


def test_the_profile_names_the_lines_and_how_they_were_measured():
    fit = ElementwiseFit.from_points({"plain": [(1e5, 20e-6), (1e6, 110e-6)], "transcendental": [(1e5, 30e-6), (1e6, 210e-6)],
                                      "routing": [(16.0, 60e-6), (512.0, 110e-6)]}, "each of 2 gloo ranks at once")
    assert fit.fixed_s == pytest.approx({"plain": 10e-6, "transcendental": 10e-6, "routing": 58.3871e-6}, rel=1e-4)
    assert fit.per_s == pytest.approx({"plain": 1e10, "transcendental": 5e9, "routing": 9.92e6})
    hw = given_host(small_rate=100e9, switch_s=0.0, elementwise=fit)
    assert ElementwiseFit.from_figures(hw.figures).time(Work({"plain": 2}, {"plain": 1e6})) == pytest.approx(2 * 10e-6 + 1e-4)
    for figure in ("elementwise_op_s", "elementwise_units_per_s"):
        source = hw.sources[figure]
        assert "each of 2 gloo ranks at once" in source and "torch.add" in source and "torch.tanh" in source
        assert "select_experts" in source and "plain: 0.1 MB 20 us, 1 MB 110 us" in source


@pytest.mark.parametrize("name", ["h800", "h100", "h200", "b200"])
def test_the_gpu_profiles_have_no_elementwise_lines(name):
    assert ElementwiseFit.from_figures(load_hardware(name).figures) is None


@pytest.mark.slow
def test_the_elementwise_lines_are_measured_here():
    fit = measure_elementwise(rows=(8, 64), repeat=2, warmup=1)
    assert set(fit.points) == {"plain", "transcendental", "routing"}
    for kind, points in fit.points.items():
        assert [x for x, _ in points] == ([8.0, 64.0] if kind == "routing" else sorted(x for x, _ in points))
        assert all(s > 0 for _, s in points) and fit.fixed_s[kind] >= 0 and fit.per_s[kind] > 0
        assert math.isfinite(fit.per_s[kind]) or UNRESOLVED in fit.describe(kind)


def test_a_line_whose_slope_is_not_positive_is_flagged_in_the_profiles_source():
    fit = ElementwiseFit.from_points({"plain": [(1e5, 20e-6), (1e6, 110e-6)], "transcendental": [(1e5, 30e-6), (1e6, 210e-6)],
                                      "routing": [(16.0, 170e-6), (512.0, 160e-6)]}, "each of 2 gloo ranks at once")
    assert math.isinf(fit.per_s["routing"]) and math.isfinite(fit.per_s["plain"])
    hw = given_host(small_rate=100e9, switch_s=0.0, elementwise=fit)
    for figure in ("elementwise_op_s", "elementwise_units_per_s"):
        assert f"routing: 16 tokens 170 us, 512 tokens 160 us ({UNRESOLVED})" in hw.sources[figure]
        assert "plain: 0.1 MB 20 us, 1 MB 110 us;" in hw.sources[figure]


def test_the_lines_are_measured_on_one_thread_and_the_callers_count_comes_back(monkeypatch):
    seen, tanh = [], torch.tanh
    monkeypatch.setattr(torch, "tanh", lambda x: seen.append(torch.get_num_threads()) or tanh(x))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        measure_elementwise(rows=(4, 8), repeat=1, warmup=0)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
