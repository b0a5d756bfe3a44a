"""Mixtral: every layer is an MoE block (`block_sparse_moe`, experts `w1` gate, `w3` up,
`w2` down) with softmax top-k routing renormalised over the chosen experts."""

from __future__ import annotations

import re

from torch import nn

from tandem.models.decoder import MoEDecoderForCausalLM
from tandem.models.hf_config import config_value
from tandem.models.layers import Attention, MoEBlock

#: transformers >= 5 names the block `mlp` in memory; checkpoints say `block_sparse_moe`.
_MLP_ALIAS = re.compile(r"^(model\.layers\.\d+)\.mlp\.")


class MixtralForCausalLM(MoEDecoderForCausalLM):
    architectures = ("MixtralForCausalLM",)
    mlp_name = "block_sparse_moe"

    default_rope_theta = 1e6

    def build_attention(self, layer_idx: int) -> Attention:
        return self.attention()

    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        return MoEBlock(
            config_value(config, "hidden_size"),
            config_value(config, "intermediate_size"),
            config_value(config, "num_local_experts", "num_experts"),
            config_value(config, "num_experts_per_tok"),
            renormalize=True,
            moe=self.moe,
            proj_names=("w1", "w3", "w2"),
            dtype=self.dtype,
        )

    def rename(self, name: str) -> str:
        return _MLP_ALIAS.sub(r"\1.block_sparse_moe.", name)

    def sliding_window(self) -> int | None:
        return config_value(self.config, "sliding_window", default=None)
