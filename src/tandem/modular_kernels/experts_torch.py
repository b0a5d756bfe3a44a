"""Grouped expert GEMMs with plain torch ops, in both activation formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.modular_kernels.interfaces import ActivationFormat, Experts, ExpertTokens
from tandem.modular_kernels.routing import expert_mlp


class TorchExperts(Experts):
    """STANDARD format: loop over local experts, gather their rows, weight and scatter-add."""

    activation_format = ActivationFormat.STANDARD
    name = "torch"

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = tokens.dequantized()
        ids, weights = tokens.topk_ids, tokens.topk_weights
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w1.shape[0]):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert_mlp(x[rows].float(), w1[e].float(), w2[e].float())
            out.index_add_(0, rows, y * weights[rows, slots].float().unsqueeze(-1))
        return out.to(tokens.dtype)


class TorchBatchedExperts(Experts):
    """MASKED format: one batched GEMM over every expert's slot; static shapes, so a graph
    capture can record it. Rows past each expert's count are zeroed."""

    activation_format = ActivationFormat.MASKED
    name = "torch"

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = tokens.dequantized().float()
        gate, up = torch.bmm(x, w1.float().transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, w2.float().transpose(1, 2))
        rows = torch.arange(x.shape[1], device=x.device)
        valid = rows.unsqueeze(0) < tokens.expert_num_tokens.to(x.device).unsqueeze(1)
        return (out * valid.unsqueeze(-1)).to(tokens.dtype)
