"""Decoder layers as TBO operations: the stage cuts of SGLang's `operations_strategy.py`,
dense layers outside the overlap, and the operations computing what the forward computes."""

from __future__ import annotations

import pytest
import torch

from tandem.contexts import ForwardContext, execute_operations, set_forward_context
from tandem.contexts.operations import to_stages
from tandem.models.qwen_moe import Qwen3MoeForCausalLM
from tandem.models.tiny_moe import build_tiny_moe
from tandem.worker import BlockAllocator, ScheduledChunk, allocate_kv_caches, build_step_inputs
from tests.support.hf_checkpoints import COMMON, FAMILIES


def stage_names(strategy) -> list[list[str]]:
    return [[op.debug_name.split(".")[-1].removeprefix("op_") for op in stage] for stage in to_stages(strategy.operations)]


ATTENTION = ["comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp"]


def test_deepseek_layer_stages_are_sglangs():
    layer = build_tiny_moe().model.model.layers[1]
    decode = layer.operations_strategy(decode=True)
    assert decode.delta_stages == 2
    assert stage_names(decode) == [
        ["comm_prepare_attn", "attn_prepare"],
        ["attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_prepare"],
        ["dispatch_send", "shared_experts"],
        ["dispatch_recv", "experts", "combine_send"],
        ["combine_recv"],
        ["output", "comm_postprocess_layer"],
    ]
    prefill = layer.operations_strategy(decode=False)
    assert prefill.delta_stages == 0
    assert stage_names(prefill) == [
        [*ATTENTION, "gate", "select_experts", "dispatch_prepare", "dispatch_send"],
        ["dispatch_recv", "experts", "combine_send"],
        ["shared_experts", "combine_recv", "output", "comm_postprocess_layer"],
    ]


def test_a_send_that_holds_the_host_is_issued_after_the_prefill_yield():
    """DeepEP's normal dispatch waits on the CPU inside its send (`yields_in_send`): prefill
    cuts the stage between the dispatch's two halves, as SGLang's `dispatch_a | dispatch_b`,
    so the other ubatch's stage is queued before the host waits, and sends the combine a stage
    later, behind the other ubatch's dispatch on the library's one comm stream. Decode already
    sends after a yield; its stages do not change."""
    layer = build_tiny_moe().model.model.layers[1]
    before = {decode: stage_names(layer.operations_strategy(decode)) for decode in (True, False)}
    layer.feed_forward.kernel.prepare_finalize.yields_in_send = True  # on the instance only
    prefill = layer.operations_strategy(decode=False)
    assert prefill.delta_stages == 0
    assert stage_names(prefill) == [
        [*ATTENTION, "gate", "select_experts", "dispatch_prepare"],
        ["dispatch_send", "dispatch_recv", "experts"],
        ["combine_send", "shared_experts", "combine_recv", "output", "comm_postprocess_layer"],
    ]
    assert stage_names(layer.operations_strategy(decode=True)) == before[True]
    assert before[False][0][-2:] == ["dispatch_prepare", "dispatch_send"]


def test_qwen3_layer_stages_are_sglangs():
    _, _, overrides = FAMILIES["qwen3_moe"]
    layer = Qwen3MoeForCausalLM({**COMMON, **overrides}).model.layers[0]
    # Consecutive layers concatenate: the trailing yield ends each decode layer's last stage.
    decode = layer.operations_strategy(decode=True)
    assert stage_names(decode) == [
        ["comm_prepare_attn", "attn_prepare"],
        ["attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_prepare"],
        ["dispatch_send"],
        ["dispatch_recv", "experts", "combine_send"],
        ["combine_recv", "output", "comm_postprocess_layer"],
    ]
    assert stage_names(layer.operations_strategy(decode=False)) == [
        [*ATTENTION, "gate", "select_experts", "dispatch_prepare", "dispatch_send"],
        ["dispatch_recv", "experts", "combine_send"],
        ["combine_recv", "output", "comm_postprocess_layer"],
    ]


def test_dense_layers_run_outside_the_overlap_and_strategies_concatenate():
    model = build_tiny_moe().model  # first_k_dense_replace = 1, then two MoE layers
    assert [layer.is_sparse for layer in model.model.layers] == [False, True, True]
    decode = model.operations_strategy(decode=True)
    # Two MoE layers of six stages, the first's last stage merged with the second's first.
    assert len(to_stages(decode.operations)) == 11 and decode.delta_stages == 2
    assert len(to_stages(model.operations_strategy(decode=False).operations)) == 5


@pytest.mark.parametrize("decode", [True, False])
def test_operations_compute_the_forward(decode):
    model = build_tiny_moe().model
    blocks = 16
    model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), blocks, 4))
    allocator = BlockAllocator(blocks, reserve_null_block=True)
    lengths = [1, 1, 1] if decode else [5, 3]
    chunks = [
        ScheduledChunk(list(range(10 + i, 10 + i + n)), 7 if decode else 0, allocator.allocate(3))
        for i, n in enumerate(lengths)
    ]
    inputs = build_step_inputs(chunks, 4, None)
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
        forward = model(inputs.input_ids, inputs.positions)
        staged = model.operations_output(
            execute_operations(
                model.operations_inputs(inputs.input_ids, inputs.positions), model.operations_strategy(decode).operations
            )
        )
    torch.testing.assert_close(staged, forward, rtol=0, atol=0)
