"""The norm-like ops of a layer are priced as the runtime's layer code issues them (#31 after
G9): the residual add runs inside the next input norm (one kernel: x and residual in, normed and
sum out), so `comm_postprocess_layer` costs nothing; the passes are counted by running the
layer's own op methods, so a layer that summed apart again would be priced apart again."""

from __future__ import annotations

import pytest

from tandem.models.layer_operations import DecoderLayerOperations
from tandem.simulate import load_hardware, model_shape
from tandem.simulate.ops import FINAL_NORM_PASSES, NORM_PASSES, Layout, OpCosts, UBatchWork, layer_norm_passes

H800 = load_hardware("h800")
PREFILL = Layout(ep=32, decode=False, low_latency=False)


def test_the_passes_are_those_the_layer_issues():
    assert layer_norm_passes(shared=True) == {
        "comm_prepare_attn": 4, "comm_prepare_mlp": 4, "output": 3, "comm_postprocess_layer": 0,
    }  # fmt: skip
    # Without shared experts `output` hands the routed output on as it is.
    assert layer_norm_passes(shared=False)["output"] == 0
    assert NORM_PASSES == 11 and FINAL_NORM_PASSES == 4


def test_a_layer_that_summed_apart_would_be_priced_apart(monkeypatch):
    """The layer as it was before G9: the residual added in `comm_postprocess_layer` (a sum: 3
    passes) and the next input norm alone (2)."""

    def prepare_attn(self, state, hidden_states, positions, residual=None):
        state["positions"], state["residual"] = positions, hidden_states
        return {"hidden_states": self.input_layernorm(hidden_states)}

    def postprocess(self, state, mlp_output):
        return {"hidden_states": mlp_output + state.pop("residual"), "positions": state.pop("positions")}

    monkeypatch.setattr(DecoderLayerOperations, "op_comm_prepare_attn", prepare_attn)
    monkeypatch.setattr(DecoderLayerOperations, "op_comm_postprocess_layer", postprocess)
    passes = layer_norm_passes(shared=True)
    assert (passes["comm_prepare_attn"], passes["comm_postprocess_layer"]) == (2, 3)
    costs = OpCosts(model_shape("deepseek-v3"), H800, PREFILL)
    assert costs.compute("comm_postprocess_layer", UBatchWork(1000, 1, 1000)) > 0.0


def test_the_add_costs_its_passes_in_the_input_norm_and_nothing_after_the_layer():
    """1,000 tokens on H800 (58.5 passes a layer measured, 11 counted): the input norm's 4 passes
    at 3.35 TB/s x 0.80, 1000 x 7168 x 2 x 4 x 58.5/11 B = 113.8 us; the hand-on costs 0."""
    costs = OpCosts(model_shape("deepseek-v3"), H800, PREFILL)
    work = UBatchWork(1000, 1, 1000)
    expected = 1000 * 7168 * 2 * 4 * 58.5 / 11 / 2.68e12
    assert costs.compute("comm_prepare_attn", work) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(113.79e-6, rel=1e-4)
    assert costs.compute("comm_postprocess_layer", work) == 0.0


def test_the_final_norm_adds_the_last_residual():
    """The head's norm, unscaled (it is not a layer's): 4 passes of 1,000 x 7168 x 2 B at 2.68 TB/s
    (42.8 us), besides lm_head on the one request's last token."""
    shape = model_shape("deepseek-v3")
    costs = OpCosts(shape, H800, PREFILL)
    lm_head = H800.gemm_time(1, shape.vocab, shape.hidden, fp8=False)
    assert costs.compute("head", UBatchWork(1000, 1, 1000)) - lm_head == pytest.approx(1000 * 7168 * 2 * 4 / 2.68e12)
