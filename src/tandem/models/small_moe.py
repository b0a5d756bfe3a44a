"""`small-moe`: a built-in model big enough that a step is tensor work, not Python.

Same family and byte tokenizer as `tiny-moe` (DeepSeek-V3 shape: MLA, one dense layer then
MoE layers with grouped sigmoid routing, one shared expert), scaled up: hidden 1024, 1 dense
+ 4 MoE layers, 16 routed experts top-2, moe_intermediate 512, MLA with 8 heads. Nothing is
downloaded: every checkpoint tensor is drawn from its own generator, seeded by the preset
seed and the tensor's name, so a rank draws only the tensors it holds (its experts, its
pipeline stage's layers) and still gets exactly the values every other layout gets.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import torch

from tandem.models.base import ModelInfo
from tandem.modular_kernels import MoEConfig
from tandem.models.tiny_moe import BOS_ID, CONFIG as TINY_CONFIG, EOS_ID, _hf_shapes, byte_model_info

SEED = 20261123

CONFIG: dict = {
    **TINY_CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}


@lru_cache(maxsize=1)
def checkpoint_shapes() -> dict[str, tuple[int, ...]]:
    return _hf_shapes(CONFIG)


@lru_cache(maxsize=None)
def small_moe_tensor(name: str) -> torch.Tensor:
    """One checkpoint tensor, drawn from a generator seeded by the preset seed and `name`
    (cached: tests build the model many times in one process). Scales as tiny-moe's:
    activations near unit size, printable bytes favoured by the head, so greedy choices are
    not near-ties that a different batch split could flip."""
    shape = checkpoint_shapes()[name]
    gen = torch.Generator().manual_seed(SEED ^ zlib.crc32(name.encode()))
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return torch.ones(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    if name == "lm_head.weight":
        scale = torch.full((shape[0], 1), 0.5)
        scale[ord(" ") : ord("~") + 1] = 4.0
        return scale * torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


def build_small_moe(
    moe: MoEConfig | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", stage=None
) -> ModelInfo:
    """The small-moe model for this expert-parallel rank and pipeline stage, on `device`;
    only the tensors this rank holds are drawn."""
    from tandem.models.deepseek import DeepseekV3ForCausalLM

    with torch.device(device):
        model = DeepseekV3ForCausalLM(dict(CONFIG), moe=moe, dtype=dtype, stage=stage)
    # Each rank draws only its own experts (and its stage's layers) of the one checkpoint.
    model.load_weights((name, small_moe_tensor(name)) for name in checkpoint_shapes() if model.checkpoint_selection(name))
    model.prepare_weights_after_loading()
    model.eval()
    return byte_model_info(model, CONFIG["max_position_embeddings"], "small-moe")


__all__ = ["CONFIG", "build_small_moe", "small_moe_tensor"]
