"""`deepseek-v2-lite-random`: a DeepSeek-V2-Lite-shaped model with seeded random weights,
generated on the device, for GPU benchmarks without a download.

The shape is V2-Lite's (MLA with kv_lora_rank 512, no q LoRA, 16 heads; 27 layers, the first
dense; 64 routed experts top-6 with softmax routing and 2 shared experts; hidden 2048), about
15.7 B parameters: ~31 GB in bf16. Weights are normal draws scaled by 1/sqrt(fan-in) from
one generator on the target device, in parameter order, so a run is repeatable on one
device type. The tokenizer is tiny-moe's byte tokenizer (ids below 258 of the 102400 vocab).
`overrides` shrinks it (tests build it at a tiny scale on CPU).
"""

from __future__ import annotations

import torch

from tandem.models.base import ModelInfo
from tandem.modular_kernels import MoEConfig

SEED = 20261122

DEEPSEEK_V2_LITE: dict = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def build_random_deepseek_v2_lite(
    moe: MoEConfig | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    overrides: dict | None = None,
    seed: int = SEED,
) -> ModelInfo:
    from tandem.models.deepseek import DeepseekV2ForCausalLM
    from tandem.models.tiny_moe import byte_model_info

    config = {**DEEPSEEK_V2_LITE, **(overrides or {})}
    device = torch.device(device)
    with torch.device(device):
        model = DeepseekV2ForCausalLM(dict(config), moe=moe, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:  # norms stay at one, the bias (V3 only) at zero
                continue
            param.normal_(generator=generator).mul_(param.shape[-1] ** -0.5)
    model.prepare_weights_after_loading()
    model.eval()
    return byte_model_info(model, config["max_position_embeddings"], "deepseek-v2-lite-random")


__all__ = ["DEEPSEEK_V2_LITE", "build_random_deepseek_v2_lite"]
