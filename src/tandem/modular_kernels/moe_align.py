"""The align step of the Triton grouped GEMM: the flattened (token, k) pairs sorted by
expert, each expert's run padded to a multiple of `block_m`, so that every block of
`block_m` sorted rows belongs to one expert (vLLM's `moe_align_block_size` semantics).

Two implementations with one result: `align_pairs_by_expert_torch` (static-shape torch ops,
a stable sort) and `align_pairs_by_expert_triton`, one Triton program that counts each
expert's pairs, lays out the padded runs and scatters every pair to its row, in pair order
inside an expert (the stable sort's order) with no sort at all. Neither reads a device value
on the host, and their shapes depend only on `N*K`, `num_experts` and `block_m`, so either
can sit inside a captured graph. `align_pairs_by_expert` takes the kernel on CUDA up to
`TRITON_ALIGN_MAX_PAIRS` pairs, the sort above.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.platform import triton_utils


#: The one-program kernel walks the pairs serially; above this many (a prefill) the torch
#: path's sort, about ten kernels across the GPU, wins. gpu-review-3 G4's estimate (one CTA:
#: 0.2-0.4 ms a layer at 12,288 pairs; the sort ~0.1 ms), not yet measured on a GPU.
TRITON_ALIGN_MAX_PAIRS = 4096


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Sorted rows for the worst case: every expert's run padded by `block_m - 1`."""
    return (num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m


def align_pairs_by_expert_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `align_pairs_by_expert`."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # invalid pairs sort last
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]

    # Not torch.bincount: on CUDA it reads the min and max of its input on the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded

    max_padded = padded_rows(num_pairs, num_experts, block_m)
    sorted_ok = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - start[e]
    dest = torch.where(sorted_ok, padded_start[e] + rank, torch.full_like(rank, max_padded))
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids[dest] = order
    sorted_ids = sorted_ids[:max_padded].contiguous()

    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert.to(torch.int32).contiguous()


def _define(triton) -> SimpleNamespace:
    tl = triton.language

    @triton.jit
    def align_kernel(
        ids_ptr, sorted_ids_ptr, block_expert_ptr,
        num_pairs, num_experts, max_padded,
        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        experts = tl.arange(0, BLOCK_E)
        lanes = tl.arange(0, CHUNK)
        # 1. pairs per expert (invalid ids, -1 from another rank, match no expert).
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for c0 in range(0, num_pairs, CHUNK):
            pair = c0 + lanes
            ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        counts = tl.where(experts < num_experts, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        padded_start = padded_end - padded
        # 2. every row padding, every block its expert (-1 past the last run).
        for r0 in range(0, max_padded, CHUNK):
            row = r0 + lanes
            tl.store(sorted_ids_ptr + row, tl.zeros((CHUNK,), dtype=tl.int64) + num_pairs, mask=row < max_padded)
        for b0 in range(0, max_padded // BLOCK_M, CHUNK):
            start = (b0 + lanes) * BLOCK_M
            ends_before = (padded_end[None, :] <= start[:, None]) & (experts[None, :] < num_experts)
            expert = tl.sum(ends_before.to(tl.int32), axis=1)
            expert = tl.where(expert < num_experts, expert, -1)
            tl.store(block_expert_ptr + b0 + lanes, expert.to(tl.int64), mask=start < max_padded)
        tl.debug_barrier()  # the padding above is overwritten below, by other threads
        # 3. each pair to its row: its run's start, plus the pairs of its expert before it.
        seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for c0 in range(0, num_pairs, CHUNK):
            pair = c0 + lanes
            ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
            onehot = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)
            base = tl.sum(tl.where(onehot, (padded_start + seen)[None, :], 0), axis=1)
            earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
            row = base + tl.sum(earlier.to(tl.int32), axis=1)
            valid = tl.sum(onehot.to(tl.int32), axis=1) > 0
            tl.store(sorted_ids_ptr + row, pair.to(tl.int64), mask=valid)
            seen += tl.sum(onehot.to(tl.int32), axis=0)

    return SimpleNamespace(align=align_kernel)


def align_pairs_by_expert_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `align_pairs_by_expert`; one Triton launch and one allocation."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_padded = padded_rows(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    # One buffer: the sorted rows, then each block's expert (int64 both; the GEMM reads either).
    out = torch.empty((max_padded + num_blocks,), dtype=torch.int64, device=flat.device)
    sorted_ids, block_expert = out[:max_padded], out[max_padded:]
    block_e = triton_utils.next_power_of_2(max(num_experts, 1))
    triton_utils.kernels(_define).align[(1,)](
        flat, sorted_ids, block_expert, num_pairs, num_experts, max_padded,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, min(64, 4096 // block_e)),
    )  # fmt: skip
    return sorted_ids, block_expert


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, k) pairs by expert and pad each expert's run to a multiple
    of `block_m`.

    Returns `(sorted_ids [max_padded], block_expert [max_padded // block_m])`: the pair index
    (`token * K + k`) at each sorted row, `N*K` on padding rows; and the expert of each block,
    -1 for blocks past the last expert's run. Ids outside `[0, num_experts)` (-1: another
    rank) are dropped.
    """
    if triton_utils.use_triton(topk_ids) and topk_ids.numel() <= TRITON_ALIGN_MAX_PAIRS:
        return align_pairs_by_expert_triton(topk_ids, num_experts, block_m)
    return align_pairs_by_expert_torch(topk_ids, num_experts, block_m)


__all__ = ["align_pairs_by_expert", "align_pairs_by_expert_torch", "align_pairs_by_expert_triton", "padded_rows"]
