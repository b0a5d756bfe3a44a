"""Data-parallel agreement on whether (and at what padded size) to ubatch this step.

Every DP rank runs the same collectives in the same order, so either all ranks split into
ubatches or none does; one all-reduce carries every rank's token count and wish.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.ubatch.slices import is_last_ubatch_empty


@dataclass(frozen=True)
class UBatchDecision:
    should_ubatch: bool
    num_tokens_padded: int
    num_tokens_per_rank: list[int]


def coordinate_ubatching(
    num_tokens: int,
    wants_ubatch: bool,
    *,
    group: dist.ProcessGroup | None = None,
    num_ubatches: int = 2,
) -> UBatchDecision:
    """Ubatch only if every rank with tokens wants to and, with every rank padded to the
    largest token count, no such rank's last ubatch would be pure padding (nor any ubatch
    have zero tokens). An idle rank (0 tokens) runs an all-padding dummy batch whatever the
    split, so it neither asks for ubatching nor vetoes it: a rank that ran out of work does
    not switch DBO off for the ranks that still have some.

    Without an initialised process group this is the single-rank decision.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        # Row 0: tokens per rank; row 1: 1 where the rank wants to ubatch. Summing one-hot
        # rows is an all-gather in a single all-reduce.
        table = torch.zeros(2, world, dtype=torch.int64)
        table[0, rank] = num_tokens
        table[1, rank] = int(bool(wants_ubatch))
        dist.all_reduce(table, group=group)
        per_rank = [int(n) for n in table[0].tolist()]
        wants = [bool(w) for w in table[1].tolist()]
    else:
        per_rank, wants = [int(num_tokens)], [bool(wants_ubatch)]

    padded = max(per_rank)
    busy = [r for r, n in enumerate(per_rank) if n > 0]
    should = (
        bool(busy)
        and all(wants[r] for r in busy)
        and padded >= num_ubatches
        and not any(is_last_ubatch_empty(per_rank[r], padded, num_ubatches) for r in busy)
    )
    return UBatchDecision(should, padded, per_rank)
