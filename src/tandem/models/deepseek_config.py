"""The fields of a Hugging Face DeepSeek-V2/V3 config that tandem's DeepSeek uses, read once,
checked and given their version's defaults (V2: softmax routing, interleaved RoPE; V3:
sigmoid routing with `noaux_tc`, `rope_interleave` from the config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.models.hf_config import check_silu, config_value
from tandem.models.rope import RopeConfig, rope_config


#: Routing: plain top-k, top-k within the best groups (ranked by their best expert), and V3's
#: grouped top-k on bias-corrected scores (groups ranked by the sum of their two best).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class DeepseekConfig:
    """What MLA, the routing and the layer plan read of an HF DeepSeek-V2/V3 config, normalised
    (vocabulary, norms and tying the shared decoder reads from the HF config itself)."""

    version: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int | None
    topk_group: int | None
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rope: RopeConfig
    rope_interleave: bool
    attention_bias: bool
    num_nextn_predict_layers: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def grouped_routing(self) -> bool:
        return self.topk_method in ("group_limited_greedy", "noaux_tc") and (self.n_group or 1) > 1

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, config: Any, version: int) -> "DeepseekConfig":
        """From an HF config object or its `config.json` dict (old `rope_theta` +
        `rope_scaling` or transformers-5 `rope_parameters`)."""
        if isinstance(config, DeepseekConfig):
            return config
        check_silu(config)
        if config_value(config, "mlp_bias", default=False):
            raise NotImplementedError("DeepSeek with mlp_bias=True is not supported")
        heads = int(config_value(config, "num_attention_heads"))
        kv_heads = int(config_value(config, "num_key_value_heads", default=heads))
        if kv_heads != heads:
            raise ValueError(f"MLA expands keys/values to every head: num_key_value_heads={kv_heads} != {heads}")
        q_lora = config_value(config, "q_lora_rank", default=None)
        topk_method = str(config_value(config, "topk_method", default="greedy" if version == 2 else "noaux_tc"))
        if topk_method not in TOPK_METHODS:
            raise NotImplementedError(f"DeepSeek topk_method={topk_method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
        return cls(
            version=version,
            hidden_size=int(config_value(config, "hidden_size")),
            intermediate_size=int(config_value(config, "intermediate_size")),
            moe_intermediate_size=int(config_value(config, "moe_intermediate_size", default=0)),
            num_hidden_layers=int(config_value(config, "num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(config_value(config, "kv_lora_rank")),
            qk_nope_head_dim=int(config_value(config, "qk_nope_head_dim")),
            qk_rope_head_dim=int(config_value(config, "qk_rope_head_dim")),
            v_head_dim=int(config_value(config, "v_head_dim")),
            n_routed_experts=config_value(config, "n_routed_experts", default=None),
            n_shared_experts=int(config_value(config, "n_shared_experts", default=0)),
            num_experts_per_tok=int(config_value(config, "num_experts_per_tok", default=1)),
            n_group=config_value(config, "n_group", default=None),
            topk_group=config_value(config, "topk_group", default=None),
            topk_method=topk_method,
            scoring_func=str(config_value(config, "scoring_func", default="softmax" if version == 2 else "sigmoid")),
            norm_topk_prob=bool(config_value(config, "norm_topk_prob", default=version == 3)),
            routed_scaling_factor=float(config_value(config, "routed_scaling_factor", default=1.0)),
            first_k_dense_replace=int(config_value(config, "first_k_dense_replace", default=0)),
            moe_layer_freq=int(config_value(config, "moe_layer_freq", default=1)),
            rope=rope_config(config, supported=("default", "yarn")),
            # V2 always rotates interleaved pairs; V3 lets the config choose.
            rope_interleave=True if version == 2 else bool(config_value(config, "rope_interleave", default=True)),
            attention_bias=bool(config_value(config, "attention_bias", default=False)),
            num_nextn_predict_layers=int(config_value(config, "num_nextn_predict_layers", default=0)),
        )


__all__ = ["TOPK_METHODS", "DeepseekConfig"]
