"""Grouped expert GEMMs with plain torch ops, in both activation formats.

Both run the up projection (gate and up) once for every row and the down projection per
block (`apply_blocks`), so SBO `combine-down-gemm` sends each block's combine while the
next block's down projection runs; `apply` is the one-block case.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from tandem.modular_kernels.interfaces import ActivationFormat, Experts, ExpertTokens


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchExperts(Experts):
    """STANDARD format: per local expert, gather its rows, weight and scatter-add."""

    activation_format = ActivationFormat.STANDARD
    name = "torch"
    blocks_down_projection = True
    #: each expert's rows are found with `nonzero` (a host sync).
    graph_capturable = False

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return next(self._blocks(tokens, w1, w2, None))[1]

    def apply_blocks(self, tokens, w1, w2, blocks) -> Iterator[tuple[int, torch.Tensor]]:
        return self._blocks(tokens, w1, w2, blocks)

    def _blocks(self, tokens, w1, w2, blocks: list | None) -> Iterator[tuple[int, torch.Tensor]]:
        """`blocks=None`: one block of every row in order (`apply`)."""
        x = tokens.dequantized()
        ids, weights = tokens.topk_ids, tokens.topk_weights
        if blocks is not None:
            block_of_row = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
            position = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            for b, rows in enumerate(blocks):
                block_of_row[rows] = b
                position[rows] = torch.arange(len(rows), device=x.device)
        # Up projection once per expert over all its rows: (rows, top-k slot, activation).
        activated = []
        for e in range(w1.shape[0]):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                activated.append((e, rows, slots, _silu_and_mul(x[rows].float() @ w1[e].float().t())))
        for b, block in enumerate([None] if blocks is None else blocks):
            out = torch.zeros((x.shape[0] if block is None else len(block), x.shape[1]), dtype=torch.float32, device=x.device)
            for e, rows, slots, act in activated:
                if block is not None:
                    mine = (block_of_row[rows] == b).nonzero(as_tuple=True)[0]
                    if mine.numel() == 0:
                        continue
                    rows, slots, act = rows[mine], slots[mine], act[mine]
                y = act @ w2[e].float().t()
                out.index_add_(0, rows if block is None else position[rows], y * weights[rows, slots].float().unsqueeze(-1))
            yield b, out.to(tokens.dtype)


class TorchBatchedExperts(Experts):
    """MASKED format: batched GEMMs over every expert's slot; static shapes, so a graph
    capture can record it. Rows past each expert's count are zeroed."""

    activation_format = ActivationFormat.MASKED
    name = "torch"
    blocks_down_projection = True

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return next(self.apply_blocks(tokens, w1, w2, [slice(None)]))[1]

    def apply_blocks(self, tokens, w1, w2, blocks) -> Iterator[tuple[int, torch.Tensor]]:
        x = tokens.dequantized().float()
        act = _silu_and_mul(torch.bmm(x, w1.float().transpose(1, 2)))
        rows = torch.arange(x.shape[1], device=x.device)
        valid = rows.unsqueeze(0) < tokens.expert_num_tokens.to(x.device).unsqueeze(1)
        for b, experts in enumerate(blocks):
            out = torch.bmm(act[experts], w2[experts].float().transpose(1, 2))
            yield b, (out * valid[experts].unsqueeze(-1)).to(tokens.dtype)
