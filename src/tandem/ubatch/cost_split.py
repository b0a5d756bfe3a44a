"""Cost-aware ubatch splits: cut where each ubatch's predicted work is equal, not where its
token count is.

A token's work is its share of the dense and MoE layers (the same for every token) plus
its attention over the keys before it (its position + 1). With one long prefill beside many
short requests, the long request's late tokens attend over far more keys than anyone
else's, so the token midpoint leaves one ubatch with most of the attention; balancing
the predicted cost moves the cut. A request may straddle a cut, exactly as with
`split_by_tokens`, and the output is the same `UBatchSlice` list.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence

from tandem.ubatch.slices import UBatchSlice, _check_num_ubatches, slices_at_cuts

#: Attention work of one (query, key) pair relative to one token's dense + MoE work when
#: nothing better is known (a measured ratio comes from the overlap planner's fit).
DEFAULT_ATTENTION_WEIGHT = 1.0 / 512


def attention_work(num_scheduled_tokens: Sequence[int], context_lens: Sequence[int]) -> int:
    """(query, key) pairs of causal attention: request r's i-th new token sits at position
    `context_lens[r] + i` and attends over that many keys plus itself."""
    total = 0
    for n, ctx in zip(num_scheduled_tokens, context_lens, strict=True):
        total += n * ctx + n * (n + 1) // 2
    return total


def split_by_cost(
    num_scheduled_tokens: Sequence[int],
    context_lens: Sequence[int],
    num_ubatches: int = 2,
    num_tokens_padded: int | None = None,
    *,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
) -> list[UBatchSlice]:
    """Cut so every ubatch gets about 1/n of the predicted work: one unit per token (padding
    included) plus `attention_weight` per (query, key) pair. `context_lens[r]` is request
    r's cached tokens before this step. Every ubatch keeps at least one token."""
    _check_num_ubatches(num_ubatches)
    counts = [int(n) for n in num_scheduled_tokens]
    contexts = [int(c) for c in context_lens]
    if len(contexts) != len(counts):
        raise ValueError(f"{len(counts)} requests but {len(contexts)} context lengths")
    if any(n < 0 for n in counts) or any(c < 0 for c in contexts):
        raise ValueError("token counts and context lengths must be non-negative")
    if attention_weight < 0:
        raise ValueError(f"attention_weight must be >= 0, got {attention_weight}")
    num_tokens = sum(counts)
    padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    if padded < num_tokens:
        raise ValueError(f"num_tokens_padded={padded} is smaller than the {num_tokens} scheduled tokens")
    if padded < num_ubatches:
        raise ValueError(f"{padded} tokens cannot make {num_ubatches} non-empty ubatches")

    # Work of every token in batch order, then the padding rows (no attention).
    work = [1.0 + attention_weight * (ctx + i + 1) for n, ctx in zip(counts, contexts) for i in range(n)]
    work += [1.0] * (padded - num_tokens)
    cumulative = [0.0, *itertools.accumulate(work)]
    total = cumulative[-1]
    cuts = []
    for i in range(1, num_ubatches):
        target = total * i / num_ubatches
        at = bisect.bisect_left(cumulative, target)
        # The nearer of the two boundaries around the target, keeping >= 1 token per ubatch.
        if at > 0 and target - cumulative[at - 1] <= cumulative[min(at, padded)] - target:
            at -= 1
        low = (cuts[-1] if cuts else 0) + 1
        cuts.append(min(max(at, low), padded - (num_ubatches - i)))
    return slices_at_cuts(counts, cuts, padded)


__all__ = ["DEFAULT_ATTENTION_WEIGHT", "attention_work", "split_by_cost"]
