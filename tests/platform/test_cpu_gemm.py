"""CPU weight GEMMs on oneDNN-packed weights: the same products as `F.linear`; a module weight
packed once and again whenever it changes (in place, swapped, cast); never a tensor made for one
call; outside graph captures; and the plain op wherever oneDNN does not apply."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.linear import Linear
from tandem.platform import cpu_gemm, cpu_kernels
from tandem.platform.cpu_gemm import grouped_linear, joined_linear, linear

needs_onednn = pytest.mark.skipif(not cpu_gemm._AVAILABLE, reason="this torch build has no oneDNN")


@pytest.fixture
def onednn_only():
    """The oneDNN path alone: tandem's panel kernel would take these tests' few rows of small
    weights (its own tests are in test_cpu_kernels.py)."""
    with cpu_kernels.switched_off():
        yield


def _parameter(*shape, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), requires_grad=False)


def _record_rows(monkeypatch, op: str) -> list[int]:
    """The leading size of the first argument of every call of `torch.ops.mkldnn.<op>`."""
    rows = []
    real = getattr(torch.ops.mkldnn, op)

    def recording(tensor, *args):
        rows.append(tensor.shape[0])
        return real(tensor, *args)

    monkeypatch.setattr(cpu_gemm.torch.ops.mkldnn, op, recording)
    return rows


def _count_packings(monkeypatch) -> list[int]:
    return _record_rows(monkeypatch, "_reorder_linear_weight")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 257])
def test_linear_equals_f_linear(rows, monkeypatch, onednn_only):
    packings = _count_packings(monkeypatch)
    g = torch.Generator().manual_seed(rows)
    weight, bias = _parameter(384, 256, seed=rows), torch.randn(384, generator=g)  # big enough to pack
    x = torch.randn(rows, 256, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
        # leading dimensions and a strided input
        x3 = torch.randn(2, rows, 512, generator=g)[..., ::2]
        torch.testing.assert_close(linear(x3, weight), F.linear(x3, weight), atol=1e-4, rtol=1e-4)
    assert packings == [384]


@needs_onednn
def test_a_weight_is_packed_once_and_again_whenever_it_changes(monkeypatch, onednn_only):
    packings = _count_packings(monkeypatch)
    layer = Linear(256, 320, bias=False)
    x = torch.randn(4, 256)
    with torch.inference_mode():
        layer(x), layer(x), layer(x)
        assert packings == [320]
        layer.weight.detach()[:8].copy_(torch.randn(8, 256))  # the loaders write this way
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
        layer.weight.data = torch.randn(320, 256)  # swapped
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
        assert packings == [320] * 3
        layer.double()  # cast: oneDNN does not take float64, the plain op runs
        torch.testing.assert_close(layer(x.double()), F.linear(x.double(), layer.weight))
        router = Linear(256, 16, bias=False)  # too small to gain: oneDNN's fixed cost outweighs it
        torch.testing.assert_close(router(x), F.linear(x, router.weight))
    assert packings == [320] * 3


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_joined_linear_is_one_gemm_over_the_weights_joined(rows, dtype, monkeypatch):
    """q, k and v of an attention layer: one packing of the three weights joined and one GEMM
    per call (tandem's panel kernel or oneDNN, by row count), the outputs equal to three
    `F.linear`s; a change to any one weight packs them again."""
    packings = _count_packings(monkeypatch)
    weights = tuple(_parameter(n, 256, seed=n).to(dtype) for n in (256, 128, 128))
    weights = tuple(nn.Parameter(w, requires_grad=False) for w in weights)
    biases = (None, torch.randn(128).to(dtype), None)
    x = torch.randn(rows, 256).to(dtype)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    with torch.inference_mode():
        with torch.profiler.profile() as profile:
            got = joined_linear(x, weights, biases)
        gemms = [e.name for e in profile.events() if e.name in ("tandem::cpu_panel_linear", "mkldnn::_linear_pointwise")]
        assert len(gemms) == 1
        for part, weight, bias in zip(got, weights, biases):
            torch.testing.assert_close(part, F.linear(x, weight, bias), **tolerance)
        joined_linear(x, weights, biases)
        weights[2].detach()[:4].copy_(torch.zeros(4, 256))
        torch.testing.assert_close(joined_linear(x, weights, biases)[2], F.linear(x, weights[2]), **tolerance)
    if gemms == ["mkldnn::_linear_pointwise"]:
        assert packings == [512, 512]


def test_what_is_not_a_module_weight_or_not_taken_by_onednn_runs_the_plain_op(monkeypatch):
    packings = _count_packings(monkeypatch)
    weight = _parameter(512, 128)
    x = torch.randn(3, 128)
    with torch.inference_mode():
        made_for_this_call = weight.detach().clone()
        torch.testing.assert_close(linear(x, made_for_this_call), F.linear(x, made_for_this_call))
        torch.testing.assert_close(linear(x.double(), weight.double()), F.linear(x.double(), weight.double()))
        assert linear(x[:0], weight).shape == (0, 512)
    trained = nn.Parameter(weight.detach().clone())
    out = linear(x, trained)  # gradients wanted: the autograd op
    out.sum().backward()
    assert trained.grad is not None
    assert packings == []


@needs_onednn
def test_packing_stays_out_of_a_captured_graph_and_the_module_still_saves():
    from tandem.platform.cpu_graph import CpuGraph

    layer = Linear(256, 320, bias=False).requires_grad_(False)
    static_x = torch.randn(4, 256)
    graph = CpuGraph()
    with torch.inference_mode():
        static_y = graph.capture(layer, static_x)  # the first use: packs, outside the recording
        recorded = [str(step.func) for step in graph._steps]
        assert not any("reorder" in op for op in recorded), recorded
        new_x = torch.randn(4, 256)
        static_x.copy_(new_x)
        graph.replay()
        torch.testing.assert_close(static_y, F.linear(new_x, layer.weight), atol=1e-4, rtol=1e-4)
    torch.save(layer, io.BytesIO())  # the packed copy is not an attribute of the weight


@needs_onednn
def test_bfloat16_runs_whether_or_not_the_cpu_packs_it():
    weight, x = nn.Parameter(torch.randn(512, 128).bfloat16(), requires_grad=False), torch.randn(5, 128).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=2e-2, rtol=2e-2)


@needs_onednn
def test_a_weight_made_under_inference_mode_is_packed_once(monkeypatch, onednn_only):
    packings = _count_packings(monkeypatch)
    with torch.inference_mode():
        weight, x = nn.Parameter(torch.randn(512, 128), requires_grad=False), torch.randn(2, 128)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert packings == [512]


@needs_onednn
def test_grouped_linear_multiplies_each_experts_rows_by_its_weight(monkeypatch):
    packings = _count_packings(monkeypatch)
    weights = _parameter(4, 256, 256)
    counts = [2, 0, 5, 1]
    x = torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(1))
    expected = torch.cat([x[s : s + c] @ weights[e].t() for e, (s, c) in enumerate(zip([0, 2, 2, 7], counts))])
    with torch.inference_mode():
        torch.testing.assert_close(grouped_linear(x, weights, counts), expected, atol=1e-4, rtol=1e-4)
        grouped_linear(x, weights, counts)
        assert grouped_linear(x, weights.detach().clone(), counts) is None  # not a module weight
        assert grouped_linear(x.double(), weights.double(), counts) is None  # the caller's grouped GEMM runs
    assert packings == [256] * 4  # every expert once, at the first call


@needs_onednn
def test_row_counts_are_bucketed_so_onednn_shapes_repeat(monkeypatch, onednn_only):
    """oneDNN builds a primitive per input shape; the packed GEMM pads a row count up to its
    bucket (as is up to 16, then multiples of 16, above 256 multiples of 64) and returns only
    the real rows."""
    shapes = _record_rows(monkeypatch, "_linear_pointwise")
    weight = _parameter(384, 256)
    weights = nn.Parameter(torch.randn(3, 384, 256), requires_grad=False)
    g = torch.Generator().manual_seed(3)
    for rows in (5, 17, 31, 300):
        x = torch.randn(rows, 256, generator=g)
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-4)
    assert shapes == [5, 32, 32, 320]
    shapes.clear()
    counts = [17, 0, 2]
    x = torch.randn(sum(counts), 256, generator=g)
    expected = torch.cat([x[:17] @ weights[0].t(), x[17:] @ weights[2].t()])
    torch.testing.assert_close(grouped_linear(x, weights, counts), expected, atol=1e-4, rtol=1e-4)
    assert shapes == [32, 2]


@needs_onednn
def test_the_compiled_steps_linear_op_is_the_packed_gemm():
    weight = _parameter(384, 256)
    x = torch.randn(6, 256)
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.tandem.cpu_linear(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-4)
