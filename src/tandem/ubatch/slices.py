"""Cutting a scheduled batch into ubatches along the token axis."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and the (possibly padded) token range that one ubatch runs.

    A request cut by a ubatch boundary appears in the request slices of both ubatches.
    """

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_requests(self) -> int:
        return self.request_slice.stop - self.request_slice.start


def _check_num_ubatches(num_ubatches: int) -> None:
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")


def is_last_ubatch_empty(num_tokens: int, num_tokens_padded: int, num_ubatches: int = 2) -> bool:
    """True when padding to `num_tokens_padded` would leave the last ubatch with no real token."""
    _check_num_ubatches(num_ubatches)
    return (num_tokens_padded // num_ubatches) * (num_ubatches - 1) >= num_tokens


def split_by_tokens(
    num_scheduled_tokens: Sequence[int],
    num_ubatches: int = 2,
    num_tokens_padded: int | None = None,
    split_point: int | None = None,
) -> list[UBatchSlice]:
    """Cut the batch at token `split_point * i` for i in 1..n-1.

    `num_scheduled_tokens[r]` is request r's query length this step. The last slice's token
    range ends at `num_tokens_padded` (default: the real token count); a ubatch made only
    of padding gets the empty request slice `slice(R, R)`.
    """
    _check_num_ubatches(num_ubatches)
    counts = [int(n) for n in num_scheduled_tokens]
    if any(n < 0 for n in counts):
        raise ValueError(f"num_scheduled_tokens must be non-negative, got {counts}")
    num_tokens = sum(counts)
    padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    if padded < num_tokens:
        raise ValueError(f"num_tokens_padded={padded} is smaller than the {num_tokens} scheduled tokens")
    if split_point is None:
        split_point = padded // num_ubatches
    if split_point < 0 or split_point * (num_ubatches - 1) > padded:
        raise ValueError(
            f"split_point={split_point} does not fit {num_ubatches} ubatches in {padded} tokens"
        )
    return slices_at_cuts(counts, [split_point * i for i in range(1, num_ubatches)], padded)


def slices_at_cuts(num_scheduled_tokens: Sequence[int], cuts: Sequence[int], num_tokens_padded: int) -> list[UBatchSlice]:
    """One ubatch per range between consecutive token `cuts` (non-decreasing, inside
    `[0, num_tokens_padded]`); the last range ends at `num_tokens_padded`."""
    counts = [int(n) for n in num_scheduled_tokens]
    cu = [0, *itertools.accumulate(counts)]
    num_tokens, num_requests = cu[-1], len(counts)
    bounds = [0, *cuts, num_tokens_padded]
    if any(b < a for a, b in zip(bounds, bounds[1:])) or num_tokens_padded < num_tokens:
        raise ValueError(f"cuts {list(cuts)} must be non-decreasing within [0, {num_tokens_padded}]")
    slices = []
    for start, stop in zip(bounds, bounds[1:]):
        real_stop = min(stop, num_tokens)
        if start >= real_stop:
            request_slice = slice(num_requests, num_requests)
        else:
            first = bisect.bisect_right(cu, start) - 1
            last = bisect.bisect_right(cu, real_stop - 1) - 1
            request_slice = slice(first, last + 1)
        slices.append(UBatchSlice(request_slice, slice(start, stop)))
    return slices
