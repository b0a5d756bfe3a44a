"""DeepSeek-V2 and DeepSeek-V3 on the shared decoder: multi-head latent attention
(`mla.py`) and routed + shared experts through a `FusedMoEModularKernel`; the config is read
by `deepseek_config.py`, RoPE (YaRN included) is `rope.py`'s.

The math follows the Hugging Face implementations (`transformers.models.deepseek_v2` /
`deepseek_v3`). Routing: V2 softmax + `greedy` or `group_limited_greedy` (groups ranked by
their best expert); V3 sigmoid + `e_score_correction_bias` + `noaux_tc` (groups ranked by
the sum of their two best biased scores, weights from the unbiased scores); renormalised
when `norm_topk_prob`, then times `routed_scaling_factor`. The first `first_k_dense_replace`
layers (and those off `moe_layer_freq`) have a dense MLP.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tandem.distributed.partition import StageLayers
from tandem.modular_kernels import MoEConfig
from tandem.models.decoder import MoEDecoderForCausalLM
from tandem.models.deepseek_config import DeepseekConfig
from tandem.models.layers import GatedMLP, MoEBlock
from tandem.models.mla import KV_CACHE_MODES, MLAttention

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekMoE(MoEBlock):
    """Routed experts and `n_shared_experts` shared ones (one `GatedMLP` of their summed width)."""

    def __init__(self, cfg: DeepseekConfig, moe: MoEConfig, dtype: torch.dtype):
        grouped = cfg.grouped_routing
        super().__init__(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            renormalize=cfg.norm_topk_prob,
            moe=moe,
            with_shared_experts=bool(cfg.n_shared_experts),
            scoring=cfg.scoring_func,
            num_expert_group=cfg.n_group if grouped else None,
            topk_group=cfg.topk_group if grouped else None,
            correction_bias=cfg.topk_method == "noaux_tc",
            routed_scaling_factor=cfg.routed_scaling_factor,
            float32_router=True,
            dtype=dtype,
        )
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)

    def shared_experts_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x)


class _DeepseekForCausalLM(MoEDecoderForCausalLM):
    version: int = 0
    rope_types = ("default", "yarn")

    def __init__(
        self,
        config: Any,
        moe: MoEConfig | None = None,
        dtype: torch.dtype = torch.float32,
        stage: StageLayers | None = None,
        *,
        kv_cache_mode: str = "latent",
    ):
        # Read before the shared decoder builds the layers from it.
        self.deepseek = DeepseekConfig.from_hf(config, self.version)
        self.kv_cache_mode = kv_cache_mode
        super().__init__(config, moe, dtype, stage)

    def build_attention(self, layer_idx: int) -> MLAttention:
        cfg = self.deepseek
        rotary = self.shared_rotary(cfg.qk_rope_head_dim, cfg.rope, interleaved=cfg.rope_interleave)
        return MLAttention(cfg, self.dtype, self.kv_cache_mode, rotary)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.deepseek
        if cfg.is_moe_layer(layer_idx):
            return DeepseekMoE(cfg, self.moe, self.dtype)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, self.dtype)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers after the decoder's: not used for decoding."""
        match = _LAYER_INDEX.match(name)
        cfg = self.deepseek
        return bool(match) and cfg.num_hidden_layers <= int(match[1]) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    architectures = ("DeepseekV2ForCausalLM",)
    version = 2


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    architectures = ("DeepseekV3ForCausalLM",)
    version = 3


__all__ = ["DeepseekConfig", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KV_CACHE_MODES"]
