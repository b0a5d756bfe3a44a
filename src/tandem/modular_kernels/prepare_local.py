"""Single-rank dispatch/combine: no communication at all."""

from __future__ import annotations

from tandem.modular_kernels.interfaces import ActivationFormat, ExpertTokens, PrepareAndFinalize
from tandem.modular_kernels.quant import quantize_fp8_per_token_group


class LocalPrepareAndFinalize(PrepareAndFinalize):
    activation_format = ActivationFormat.STANDARD
    name = "local"

    def __init__(self, num_experts: int):
        super().__init__(num_experts)

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        scales = None
        payload = hidden
        if use_fp8:
            payload, scales = quantize_fp8_per_token_group(hidden)
        tokens = ExpertTokens(payload, scales, hidden.dtype, topk_ids=topk_ids, topk_weights=topk_weights)
        return None, lambda: tokens

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        return None, lambda: expert_output
