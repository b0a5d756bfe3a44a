"""Per-ubatch attention metadata from the whole batch's varlen metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.ubatch.slices import UBatchSlice


@dataclass(frozen=True)
class AttentionSlice:
    """Varlen attention metadata of one ubatch, `query_start_loc` rebased to 0."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int


def _as_int_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def slice_attention_metadata(
    query_start_loc: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    slices: Sequence[UBatchSlice],
) -> list[AttentionSlice]:
    """Slice `query_start_loc` (R+1 entries) and `seq_lens` (R entries) per ubatch.

    A request cut at a boundary keeps, in its earlier part, only the KV it has written so
    far (`seq_len` minus the tokens that later ubatches will add) and, in its later part,
    the full `seq_len`. Padding tokens beyond the real tokens belong to no request.
    """
    qsl = _as_int_list(query_start_loc, "query_start_loc")
    lens = _as_int_list(seq_lens, "seq_lens")
    if len(qsl) != len(lens) + 1:
        raise ValueError(
            f"query_start_loc has {len(qsl)} entries but seq_lens has {len(lens)}; expected R+1 and R"
        )
    if qsl and qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must start at 0 and be non-decreasing, got {qsl}")
    device = query_start_loc.device if isinstance(query_start_loc, torch.Tensor) else None

    out = []
    for ub in slices:
        tok_start, tok_stop = ub.token_slice.start, ub.token_slice.stop
        local_qsl, local_lens = [0], []
        for r in range(ub.request_slice.start, ub.request_slice.stop):
            q_start, q_stop = max(qsl[r], tok_start), min(qsl[r + 1], tok_stop)
            local_qsl.append(local_qsl[-1] + max(0, q_stop - q_start))
            local_lens.append(lens[r] - max(0, qsl[r + 1] - tok_stop))
        query_lens = [b - a for a, b in zip(local_qsl, local_qsl[1:])]
        out.append(
            AttentionSlice(
                query_start_loc=torch.tensor(local_qsl, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(local_lens, dtype=torch.int32, device=device),
                max_query_len=max(query_lens, default=0),
            )
        )
    return out
