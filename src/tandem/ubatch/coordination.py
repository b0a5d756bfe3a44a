"""Data-parallel agreement on whether (and at what padded size) to ubatch this step.

Every DP rank runs the same collectives in the same order, so either all ranks split into
ubatches or none does; one all-reduce carries every rank's token count and wish, and,
under the overlap planner, every rank's predicted step time for each overlap choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tandem.ubatch.slices import is_last_ubatch_empty


#: Predictions travel as integer nanoseconds; an unknown (infinite) one as this.
_UNKNOWN_NS = 2**62


@dataclass(frozen=True)
class UBatchDecision:
    should_ubatch: bool
    num_tokens_padded: int
    num_tokens_per_rank: list[int]
    #: Per overlap choice, the largest predicted step time over the ranks with tokens (the
    #: step takes as long as its slowest rank); None unless predictions were passed.
    predicted_s: list[float] | None = None
    #: Whether any rank's step holds a prefill (a chunk of more than one token): TBO's decode
    #: and prefill strategies order their all-to-alls differently, so the ranks pick one together.
    any_rank_prefills: bool = False

    def fits(self, num_ubatches: int) -> bool:
        """Whether `num_ubatches` ubatches leave every busy rank's last ubatch some real
        token once every rank is padded to `num_tokens_padded`."""
        busy = [n for n in self.num_tokens_per_rank if n > 0]
        padded = self.num_tokens_padded
        return (
            bool(busy)
            and padded >= num_ubatches
            and not any(is_last_ubatch_empty(n, padded, num_ubatches) for n in busy)
        )


def coordinate_ubatching(
    num_tokens: int,
    wants_ubatch: bool,
    *,
    group: dist.ProcessGroup | None = None,
    num_ubatches: int = 2,
    predicted_s: Sequence[float] | None = None,
    prefills: bool = False,
) -> UBatchDecision:
    """Ubatch only if every rank with tokens wants to and, with every rank padded to the
    largest token count, no such rank's last ubatch would be pure padding (nor any ubatch
    have zero tokens). An idle rank (0 tokens) runs an all-padding dummy batch whatever the
    split, so it neither asks for ubatching nor vetoes it: a rank that ran out of work does
    not switch DBO off for the ranks that still have some.

    `predicted_s` (the same number of entries on every rank) rides in the same all-reduce;
    the decision carries, per entry, the maximum over the busy ranks. So does `prefills`
    (this rank's step holds a prefill): the decision says whether any rank's does.

    Without an initialised process group this is the single-rank decision.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    predictions = [] if predicted_s is None else [
        _UNKNOWN_NS if not p < _UNKNOWN_NS / 1e9 else max(int(p * 1e9), 0) for p in predicted_s
    ]
    per_rank, wants, any_prefills, predicted_ns = _gather(num_tokens, wants_ubatch, prefills, predictions, group)
    padded = max(per_rank)
    busy = [r for r, n in enumerate(per_rank) if n > 0]
    decision = UBatchDecision(False, padded, per_rank)
    should = bool(busy) and all(wants[r] for r in busy) and decision.fits(num_ubatches)
    agreed = None
    if predicted_s is not None:
        ranks = busy or range(len(per_rank))
        agreed = [
            float("inf") if max(row[r] for r in ranks) >= _UNKNOWN_NS else max(row[r] for r in ranks) / 1e9
            for row in predicted_ns
        ]
    return UBatchDecision(should, padded, per_rank, agreed, any_prefills)


def _gather(
    num_tokens: int, wants_ubatch: bool, prefills: bool, predictions: list[int], group: dist.ProcessGroup | None
) -> tuple[list[int], list[bool], bool, list[list[int]]]:
    """Every rank's token count and wish, whether any rank prefills, and every rank's
    predictions (one row per entry, one column per rank), in one all-reduce."""
    # A one-rank group (a pipeline stage without DP) has nothing to agree on: skip the
    # all-reduce, a gloo round trip on every micro-batch.
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return [int(num_tokens)], [bool(wants_ubatch)], bool(prefills), [[p] for p in predictions]
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # Row 0: tokens per rank; row 1: 1 where the rank wants to ubatch; row 2: 1 where it
    # prefills; rows 3..: the rank's predictions. Summing one-hot columns is an
    # all-gather in one all-reduce.
    table = torch.zeros(3 + len(predictions), world, dtype=torch.int64)
    table[0, rank] = num_tokens
    table[1, rank] = int(bool(wants_ubatch))
    table[2, rank] = int(bool(prefills))
    if predictions:
        table[3:, rank] = torch.tensor(predictions, dtype=torch.int64)
    dist.all_reduce(table, group=group)
    per_rank = [int(n) for n in table[0].tolist()]
    wants = [bool(w) for w in table[1].tolist()]
    return per_rank, wants, bool(table[2].any()), table[3:].tolist()
