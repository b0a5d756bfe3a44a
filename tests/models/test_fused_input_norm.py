"""gpu-review-3 G9: a decoder layer hands its MLP output and its residual on unsummed, and
the next layer's input norm (after the last layer, the model's final norm) adds them in its
fused add + norm. The same bits as the layer that ended with the add (the roundings are the
same: the sum rounded to the model dtype, then the norm), on the CPU in float32 and
bfloat16, for every family the decoder builds (DeepSeek-V2/V3 MLA with a dense first layer,
Qwen2-MoE, Qwen3-MoE, Mixtral), across a pipeline-stage cut, and in kernels: the CPU runs
the add and the norm as one of tandem's kernels."""

from __future__ import annotations

import zlib

import pytest
import torch

from tandem.bench.op_count import count_ops_per_layer
from tandem.contexts import ForwardContext, set_forward_context
from tandem.distributed import stage_layers
from tandem.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tandem.models.mixtral import MixtralForCausalLM
from tandem.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tandem.platform import cpu_kernels
from tandem.worker import ScheduledChunk, allocate_kv_caches, build_step_inputs
from tests.support.hf_checkpoints import COMMON, FAMILIES

BLOCK = 4

_DEEPSEEK = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    num_hidden_layers=3, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
)  # fmt: skip

MODELS = {
    "deepseek_v2": (DeepseekV2ForCausalLM, dict(_DEEPSEEK, q_lora_rank=None, topk_method="greedy")),
    "deepseek_v3": (
        DeepseekV3ForCausalLM,
        dict(_DEEPSEEK, q_lora_rank=32, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ),
    "qwen2_moe": (Qwen2MoeForCausalLM, {**COMMON, **FAMILIES["qwen2_moe"][2]}),
    "qwen3_moe": (Qwen3MoeForCausalLM, {**COMMON, **FAMILIES["qwen3_moe"][2]}),
    "mixtral": (MixtralForCausalLM, {**COMMON, **FAMILIES["mixtral"][2]}),
}


def build(name: str, dtype: torch.dtype, stage=None):
    cls, config = MODELS[name]
    model = cls(dict(config), dtype=dtype, **({"stage": stage} if stage is not None else {}))
    for param_name, param in model.named_parameters():  # seeded by name: a stage gets the whole model's values
        noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(param_name.encode())))
        value = 1 + 0.1 * noise if param_name.endswith("norm.weight") else 0.15 * noise
        param.data.copy_(value.to(dtype))
    model.prepare_weights_after_loading()
    return model


def unfused_forward(model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The decoder as it was: each layer ends with its residual add, the next input norm is
    a norm alone."""
    stage = model.stage
    hidden = model.model.embed_tokens(input_ids) if stage.is_first else input_ids
    for layer in model.model.layers[stage.start : stage.end]:
        attn_out = layer.self_attn(positions, layer.input_layernorm(hidden))
        normed, hidden = layer.post_attention_layernorm(attn_out, hidden)
        hidden = hidden + layer.feed_forward(normed)
    return model.model.norm(hidden) if stage.is_last else hidden


def steps() -> list[list[ScheduledChunk]]:
    """A prefill of two requests (5 and 3 tokens), then a decode step of both."""
    prefill = [ScheduledChunk([3, 9, 4, 1, 7], 0, [1, 2]), ScheduledChunk([8, 2, 6], 0, [3])]
    decode = [ScheduledChunk([5], 5, [1, 2]), ScheduledChunk([11], 3, [3])]
    return [prefill, decode]


def run(models, forward) -> list[torch.Tensor]:
    """Each step's output of `models` chained (pipeline stages), every model with a fresh cache."""
    for model in models:
        model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), 8, BLOCK))
    outputs = []
    for chunks in steps():
        inputs = build_step_inputs(chunks, BLOCK, None)
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
            x = inputs.input_ids
            for model in models:
                x = forward(model, x, inputs.positions)
        outputs.append(x)
    return outputs


def fused_forward(model, input_ids, positions):
    return model(input_ids, positions)


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"step {step}: max difference {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_fused_input_norm_gives_the_unfused_layers_bits(name, dtype):
    model = build(name, dtype)
    assert_same_bits(run([model], fused_forward), run([model], unfused_forward))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_path_gives_the_same_bits(dtype):
    """Without tandem's CPU kernels (the composite add then norm, as torch.compile traces it)."""
    model = build("deepseek_v3", dtype)
    with cpu_kernels.switched_off():
        assert_same_bits(run([model], fused_forward), run([model], unfused_forward))


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe"])
def test_a_stage_boundary_hands_over_the_sum(name):
    """Stage 0 ends with `residual + hidden` (the add its last layer used to end with), so
    two stages chained give the whole model's bits, and stage 0's output is the hidden
    state the unfused layers gave."""
    layers = MODELS[name][1]["num_hidden_layers"]
    whole = build(name, torch.float32)
    stages = [build(name, torch.float32, stage=stage_layers(layers, s, 2)) for s in range(2)]
    assert_same_bits(run(stages, fused_forward), run([whole], fused_forward))
    assert_same_bits(run(stages[:1], fused_forward), run(stages[:1], unfused_forward))


def test_the_cpu_runs_each_input_norm_after_the_first_as_one_add_and_norm_kernel():
    """Per layer after the first, two `cpu_add_rms_norm` calls (input and post-attention
    norm) and no residual add of its own; the final norm is the step's last add + norm."""
    model = build("mixtral", torch.float32)
    model.bind_kv_cache(allocate_kv_caches(model.kv_cache_specs(), 8, BLOCK))
    inputs = build_step_inputs(steps()[0], BLOCK, None)

    def step():
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=inputs.attn_metadata)):
            model(inputs.input_ids, inputs.positions)

    _, counter = count_ops_per_layer(model, step)
    layers = len(model.model.layers)
    assert counter.by_op["cpu_add_rms_norm"] == 2 * layers
    assert counter.by_op["cpu_rms_norm"] == 1  # the first layer's input norm: no residual yet
