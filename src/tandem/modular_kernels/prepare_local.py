"""Single-rank dispatch/combine: no communication at all."""

from __future__ import annotations

import torch

from tandem.modular_kernels.interfaces import ActivationFormat, ExpertTokens, PrepareAndFinalize
from tandem.modular_kernels.quant import quantize_fp8_per_token_group


class LocalPrepareAndFinalize(PrepareAndFinalize):
    activation_format = ActivationFormat.STANDARD
    name = "local"
    combine_is_identity = True

    def __init__(self, num_experts: int):
        super().__init__(num_experts)

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, hidden_size: int) -> LocalPrepareAndFinalize:
        if config.group is not None and torch.distributed.get_world_size(config.group) > 1:
            raise ValueError("the 'local' all2all backend runs one rank; use torch_a2a or torch_a2a_ll with a group")
        return cls(num_experts)

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        scales = None
        payload = hidden
        if use_fp8:
            payload, scales = quantize_fp8_per_token_group(hidden)
        tokens = ExpertTokens(payload, scales, hidden.dtype, topk_ids=topk_ids, topk_weights=topk_weights)
        return None, lambda: tokens

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        return None, lambda: expert_output
