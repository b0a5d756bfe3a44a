"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.decoder import MoEDecoderForCausalLM
from tandem.models.hf_config import config_value
from tandem.models.layers import Attention, GatedMLP, MoEBlock
from tandem.models.linear import Linear


class Qwen2MoeSparseBlock(MoEBlock):
    """Routed experts plus one shared expert scaled by `sigmoid(shared_expert_gate(x))`."""

    def __init__(self, hidden_size: int, shared_intermediate_size: int, **kwargs):
        super().__init__(hidden_size, with_shared_experts=True, **kwargs)
        dtype = kwargs.get("dtype", torch.float32)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, dtype)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False, dtype=dtype)

    def shared_experts_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class _QwenMoeBase(MoEDecoderForCausalLM):
    def is_sparse_layer(self, layer_idx: int) -> bool:
        config = self.config
        mlp_only = config_value(config, "mlp_only_layers", default=[])
        step = config_value(config, "decoder_sparse_step", default=1)
        return layer_idx not in mlp_only and self.num_experts() > 0 and (layer_idx + 1) % step == 0

    def num_experts(self) -> int:
        return config_value(self.config, "num_experts", "num_local_experts", default=0)

    def moe_kwargs(self) -> dict:
        config = self.config
        return dict(
            intermediate_size=config_value(config, "moe_intermediate_size"),
            num_experts=self.num_experts(),
            top_k=config_value(config, "num_experts_per_tok"),
            renormalize=bool(config_value(config, "norm_topk_prob", default=False)),
            moe=self.moe,
            dtype=self.dtype,
        )

    def dense_mlp(self) -> GatedMLP:
        config = self.config
        return GatedMLP(config_value(config, "hidden_size"), config_value(config, "intermediate_size"), self.dtype)


class Qwen2MoeForCausalLM(_QwenMoeBase):
    architectures = ("Qwen2MoeForCausalLM",)

    def build_attention(self, layer_idx: int) -> Attention:
        return self.attention(qkv_bias=bool(config_value(self.config, "qkv_bias", default=True)))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        if not self.is_sparse_layer(layer_idx):
            return self.dense_mlp()
        hidden = config_value(self.config, "hidden_size")
        shared = config_value(self.config, "shared_expert_intermediate_size", default=0)
        if shared:
            return Qwen2MoeSparseBlock(hidden, shared, **self.moe_kwargs())
        return MoEBlock(hidden, **self.moe_kwargs())

    def sliding_window(self) -> int | None:
        config = self.config
        if not config_value(config, "use_sliding_window", default=False):
            return None
        layer_types = config_value(config, "layer_types", default=None)
        if layer_types is None:
            max_window_layers = config_value(config, "max_window_layers", default=28)
            windowed = any((i + 1) % 2 and i < max_window_layers for i in range(config_value(config, "num_hidden_layers")))
        else:
            windowed = "sliding_attention" in layer_types
        return config_value(config, "sliding_window", default=None) or None if windowed else None


class Qwen3MoeForCausalLM(_QwenMoeBase):
    architectures = ("Qwen3MoeForCausalLM",)

    def build_attention(self, layer_idx: int) -> Attention:
        bias = bool(config_value(self.config, "attention_bias", default=False))
        return self.attention(qkv_bias=bias, o_bias=bias, qk_norm_eps=config_value(self.config, "rms_norm_eps", default=1e-6))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        if not self.is_sparse_layer(layer_idx):
            return self.dense_mlp()
        return MoEBlock(config_value(self.config, "hidden_size"), **self.moe_kwargs())

    def sliding_window(self) -> int | None:
        if not config_value(self.config, "use_sliding_window", default=False):
            return None
        return config_value(self.config, "sliding_window", default=None)
