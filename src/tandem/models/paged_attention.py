"""Varlen attention over a paged KV cache, for batches that mix prefill and decode.

A step's tokens are laid out request after request; request r owns query rows
`query_start_loc[r]:query_start_loc[r+1]`, which are the *last* `q_len` positions of its
`seq_lens[r]` tokens (the earlier ones are already in the cache). Each token's new K/V is
written to cache slot `slot_mapping[t]` (block * block_size + offset), and request r reads
its whole sequence back through `block_table[r]`. Rows past `num_actual_tokens` are
padding: they write nothing and attend to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tandem.ubatch import AttentionSlice, UBatchSlice


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32, starting at 0
    seq_lens: torch.Tensor  # [R] int32: KV length including this step's tokens
    max_query_len: int
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows
    block_table: torch.Tensor  # [R, max_blocks] int32
    block_size: int

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def for_ubatch(self, ubatch: UBatchSlice, attention: AttentionSlice) -> "AttentionMetadata":
        """This step's metadata restricted to one ubatch (see `slice_attention_metadata`)."""
        return replace(
            self,
            query_start_loc=attention.query_start_loc,
            seq_lens=attention.seq_lens,
            max_query_len=attention.max_query_len,
            slot_mapping=self.slot_mapping[ubatch.token_slice],
            block_table=self.block_table[ubatch.request_slice],
        )


def write_to_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`cache [num_blocks, block_size, ...]`, `values [T, ...]`; rows with slot -1 are skipped."""
    flat = cache.view(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = values[: slot_mapping.shape[0]][keep].to(cache.dtype)


def read_from_cache(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached rows of one request, `[seq_len, ...]`."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table_row[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of `query [T, Hq, Dk]` over each request's cached K `[.., Hkv, Dk]`
    and V `[.., Hkv, Dv]` (grouped-query when Hq > Hkv); returns `[T, Hq, Dv]`, zero on
    padding rows. The caller has already written this step's K/V to the cache."""
    num_tokens, num_heads, _ = query.shape
    out = query.new_zeros((num_tokens, num_heads, value_cache.shape[-1]))
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for r, seq_len in enumerate(seq_lens):
        start, stop = qsl[r], qsl[r + 1]
        if stop == start:
            continue
        k = read_from_cache(key_cache, metadata.block_table[r], seq_len)
        v = read_from_cache(value_cache, metadata.block_table[r], seq_len)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        q = query[start:stop].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (stop - start), seq_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
        out[start:stop] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out
