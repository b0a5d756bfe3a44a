"""TBO-style batch splits: by whole sequences at the most balanced point, or inside one
sequence ("two-chunk") when no sequence boundary is balanced enough."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BalancedSplit:
    """`seq_index` is the number of sequences in part A for a sequence split, or the index
    of the sequence cut in two for a two-chunk split (it then appears in both parts).
    `token_index` is the number of tokens in part A."""

    seq_index: int
    token_index: int
    two_chunk: bool
    lens_a: list[int]
    lens_b: list[int]


def balanced_split(extend_lens: Sequence[int], threshold: float = 0.48) -> BalancedSplit:
    if not 0.0 <= threshold <= 0.5:
        raise ValueError(f"threshold must lie in [0, 0.5], got {threshold}")
    lens = [int(n) for n in extend_lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"extend_lens must be non-negative, got {lens}")
    cu = [0, *itertools.accumulate(lens)]
    total = cu[-1]

    # Most balanced sequence boundary; `<=` lets later indices win ties.
    best = 0
    for i, left in enumerate(cu):
        if abs(2 * left - total) <= abs(2 * cu[best] - total):
            best = i
    by_sequence = BalancedSplit(best, cu[best], False, lens[:best], lens[best:])

    left_share = cu[best] / total if total else 0.5
    if threshold <= left_share <= 1.0 - threshold:
        return by_sequence

    cut = total // 2
    # The sequence strictly containing the cut; a cut on a boundary is no two-chunk split.
    containing = next((i for i in range(len(lens)) if cu[i] < cut < cu[i + 1]), None)
    if containing is None or containing + 1 > cut:
        return by_sequence
    head = cut - cu[containing]
    return BalancedSplit(
        containing,
        cut,
        True,
        lens[:containing] + [head],
        [lens[containing] - head] + lens[containing + 1 :],
    )
