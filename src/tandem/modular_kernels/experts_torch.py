"""Grouped expert GEMMs with plain torch ops, in both activation formats.

Both run the up projection (gate and up) once for every row and the down projection per
block (`apply_blocks`), so SBO `combine-down-gemm` sends each block's combine while the
next block's down projection runs; `apply` is the one-block case.

On the CPU, `TorchExperts.apply` runs the whole layer in one call of tandem's kernel where it
is built (`cpu_gemm.fused_experts`). Otherwise, and for SBO's blocks, the STANDARD format
sorts the (row, top-k slot) pairs by expert once per call and runs the
sorted rows through each expert's weights in the model dtype: on CPU, where oneDNN takes the
dtype, one GEMM per expert with rows on its weights packed once (`tandem.platform.cpu_gemm`;
1.7-1.9x faster than `grouped_mm` at 4 rows per expert, whose MKL path repacks every weight on
every call); otherwise one `torch.nn.functional.grouped_mm` over all experts. The per-expert
row counts are read on the host once per call (free on CPU, where the data already lives),
never once per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from tandem.modular_kernels.interfaces import ActivationFormat, Experts, ExpertTokens
from tandem.platform.cpu_gemm import fused_experts, grouped_linear

#: dtypes `grouped_mm` takes; any other runs the same slices with one `mm` per expert.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_gemm(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`x [sum(counts), K]` holds expert e's rows at the e-th run of `counts`; returns
    `[sum(counts), N]`, each run multiplied by `weights[e] [N, K]` transposed."""
    packed = grouped_linear(x, weights, counts)
    if packed is not None:
        return packed
    if x.dtype in _GROUPED_MM_DTYPES and x.device.type == "cpu":
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return F.grouped_mm(x, weights.transpose(1, 2), offs=offsets)
    out = x.new_empty((x.shape[0], weights.shape[1]))
    start = 0
    for expert, count in enumerate(counts):
        if count:
            torch.mm(x[start : start + count], weights[expert].t(), out=out[start : start + count])
        start += count
    return out


@dataclass
class _SortedPairs:
    """The (row, slot) pairs this call computes, sorted by expert and, within an expert, by
    block: `pair[i] = row * top_k + slot` of sorted position i. `counts[e][b]` pairs of
    expert e fall in block b (read on the host once)."""

    pair: torch.Tensor
    counts: list[list[int]]

    @property
    def expert_counts(self) -> list[int]:
        return [sum(per_block) for per_block in self.counts]


def _sort_pairs(ids: torch.Tensor, block_of_row: torch.Tensor | None, num_experts: int, num_blocks: int) -> _SortedPairs:
    """One stable sort of the flattened pairs by (expert, block). Pairs with an id outside
    `[0, num_experts)` (-1: another rank's expert) or in no block sort last and are dropped."""
    top_k = ids.shape[1]
    expert = ids.reshape(-1).long()
    valid = (expert >= 0) & (expert < num_experts)
    key = expert * num_blocks
    if block_of_row is not None:
        block = block_of_row.repeat_interleave(top_k)
        valid &= block >= 0
        key = key + block
    dropped = num_experts * num_blocks
    key = torch.where(valid, key, dropped)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=dropped + 1)[:dropped].view(num_experts, num_blocks).tolist()
    kept = sum(map(sum, counts))
    return _SortedPairs(order[:kept], counts)


class TorchExperts(Experts):
    """STANDARD format: the pairs sorted by expert, one grouped GEMM per projection."""

    activation_format = ActivationFormat.STANDARD
    name = "torch"
    blocks_down_projection = True
    #: the row counts per expert are read on the host (once per call).
    graph_capturable = False

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = tokens.dequantized()
        fused = fused_experts(x, tokens.topk_ids, tokens.topk_weights, w1, w2)
        if fused is not None:
            return fused
        return next(self._blocks(x, tokens, w1, w2, None))[1]

    def apply_blocks(self, tokens, w1, w2, blocks) -> Iterator[tuple[int, torch.Tensor]]:
        return self._blocks(tokens.dequantized(), tokens, w1, w2, blocks)

    def _blocks(self, x, tokens, w1, w2, blocks: list | None) -> Iterator[tuple[int, torch.Tensor]]:
        """`x`: the tokens' rows, dequantized. `blocks=None`: one block of every row in order (`apply`)."""
        ids, weights = tokens.topk_ids, tokens.topk_weights
        top_k = ids.shape[1]
        w1, w2 = w1.to(x.dtype), w2.to(x.dtype)  # no copy when they already are (the model's case)
        block_of_row, position = None, None
        if blocks is not None:
            block_of_row = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
            position = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            for b, rows in enumerate(blocks):
                block_of_row[rows] = b
                position[rows] = torch.arange(len(rows), device=x.device)
        num_blocks = 1 if blocks is None else len(blocks)
        pairs = _sort_pairs(ids, block_of_row, w1.shape[0], num_blocks)
        act = _silu_and_mul(grouped_gemm(x[pairs.pair // top_k], w1, pairs.expert_counts))
        if blocks is None:
            y = grouped_gemm(act, w2, pairs.expert_counts)
            yield 0, _weighted_sum(y, pairs.pair, weights, x.shape[0])
            return
        # Within each expert the pairs are in block order: block b's rows of every expert, in
        # expert order, are what its down projection reads.
        sorted_block = block_of_row[pairs.pair // top_k]
        by_block = torch.sort(sorted_block, stable=True).indices
        start = 0
        for b, rows in enumerate(blocks):
            counts = [per_block[b] for per_block in pairs.counts]
            mine = by_block[start : start + sum(counts)]
            start += sum(counts)
            y = grouped_gemm(act[mine], w2, counts)
            pair = pairs.pair[mine]
            yield b, _weighted_sum(y, position[pair // top_k] * top_k + pair % top_k, weights[rows], len(rows))


def _weighted_sum(y: torch.Tensor, pair: torch.Tensor, weights: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`[num_rows, H]`: row r is `sum_k weights[r, k] * y[i]` over the sorted positions i with
    `pair[i] = r * top_k + k`; a pair that was dropped contributes nothing."""
    top_k = weights.shape[1]
    per_pair = y.new_zeros((num_rows * top_k, y.shape[1]))
    per_pair.index_copy_(0, pair, y)
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), per_pair.view(num_rows, top_k, y.shape[1])).squeeze(1)


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
