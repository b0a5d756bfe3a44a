"""MLA's two input projections as one GEMM (gpu-review-3 G9, taken on CUDA): the joined
weight gives the attention of the two projections apart, with and without a query LoRA,
its rows are the modules' weights (a later load reaches it), and the CPU keeps them apart."""

from __future__ import annotations

import pytest
import torch

from tests.support.mla_layers import CHUNKED, SHAPES
from tests.support.mla_layers import mla_config as _config
from tests.support.mla_layers import mla_layer as _layer
from tests.support.mla_layers import run_mla_steps as _run

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_input_projections_give_the_attention_of_the_two_apart(shape, dtype):
    cfg = _config(shape)
    apart, joined = _layer(cfg, dtype), _layer(cfg, dtype)
    joined.join_input_projections()
    assert joined.joined_input_weight is not None
    for want, got in zip(_run(apart, CHUNKED), _run(joined, CHUNKED)):
        torch.testing.assert_close(got, want, **TOL[dtype])


def test_a_load_after_joining_reaches_the_joined_weight():
    cfg = _config("v3_ratios")
    apart, joined = _layer(cfg, torch.float32), _layer(cfg, torch.float32)
    joined.join_input_projections()
    fresh = _layer(cfg, torch.float32, seed=1)
    with torch.no_grad():
        for layer in (apart, joined):
            layer.q_a_proj.weight.copy_(fresh.q_a_proj.weight)
            layer.kv_a_proj_with_mqa.weight.copy_(fresh.kv_a_proj_with_mqa.weight)
    rows = cfg.q_lora_rank
    assert torch.equal(joined.joined_input_weight[:rows], fresh.q_a_proj.weight)
    assert torch.equal(joined.joined_input_weight[rows:], fresh.kv_a_proj_with_mqa.weight)
    for want, got in zip(_run(apart, CHUNKED), _run(joined, CHUNKED)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_the_cpu_keeps_the_projections_apart():
    layer = _layer(_config("small"), torch.float32)
    layer.prepare_loaded_weights()
    assert layer.joined_input_weight is None
