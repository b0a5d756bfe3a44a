"""Varlen attention over a paged KV cache, for batches that mix prefill and decode.

A step's tokens are laid out request after request; request r owns query rows
`query_start_loc[r]:query_start_loc[r+1]`, which are the *last* `q_len` positions of its
`seq_lens[r]` tokens (the earlier ones are already in the cache). Each token's new K/V is
written to cache slot `slot_mapping[t]` (block * block_size + offset), and request r reads
its whole sequence back through `block_table[r]`. Rows past `num_actual_tokens` are
padding: they write nothing and attend to nothing.

A *decode-only* batch (every request one query row, `decode_only=True`) takes a vectorised
path with no host reads: the whole batch gathers its blocks at once and masks by
`seq_lens`, so it can be captured in a graph. Under a graph capture, cache writes cannot
drop padding rows by a boolean mask (a data-dependent shape); they write them into
`NULL_BLOCK` instead, which the runner's block allocator never hands out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from importlib.util import find_spec

import torch

from tandem.platform.device import to_device_async
from tandem.platform.graph import graph_capture_active
from tandem.ubatch import AttentionSlice, UBatchSlice, slice_attention_metadata

#: The cache block padding rows write into during a graph capture / replay.
NULL_BLOCK = 0


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32, starting at 0
    seq_lens: torch.Tensor  # [R] int32: KV length including this step's tokens
    max_query_len: int
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows
    block_table: torch.Tensor  # [R, max_blocks] int32
    block_size: int
    #: Every request has exactly one query row (request r is row r; rows past the
    #: requests are padding). Such batches use the graph-capturable decode path.
    decode_only: bool = False
    #: Host copies of `query_start_loc` and `seq_lens` (as vLLM keeps `*_cpu`), when the
    #: builder has them: the varlen path and the ubatch split read these instead of the
    #: device tensors, so a step on a GPU does not sync with the host to plan its loops.
    query_start_loc_host: tuple[int, ...] | None = None
    seq_lens_host: tuple[int, ...] | None = None

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_actual_tokens(self) -> int:
        return self.host_lists()[0][-1]

    def host_lists(self) -> tuple[list[int], list[int]]:
        """`query_start_loc` and `seq_lens` on the host: the kept copies, else a read."""
        if self.query_start_loc_host is not None and self.seq_lens_host is not None:
            return list(self.query_start_loc_host), list(self.seq_lens_host)
        return self.query_start_loc.tolist(), self.seq_lens.tolist()

    def split(self, slices: list[UBatchSlice]) -> list["AttentionMetadata"]:
        """One metadata per ubatch. A decode-only batch whose requests cover every row (as
        in a captured graph, where padding rows are requests of length 0) is split into
        views with no host read; anything else goes through `slice_attention_metadata`."""
        if self.decode_only and self.num_requests == self.slot_mapping.shape[0]:
            return [self.decode_rows(ub.token_slice) for ub in slices]
        attention = slice_attention_metadata(*self.host_lists(), slices)  # host tensors
        return [self.for_ubatch(ub, att) for ub, att in zip(slices, attention)]

    def decode_rows(self, rows: slice) -> "AttentionMetadata":
        n = rows.stop - rows.start
        return replace(
            self,
            query_start_loc=torch.arange(n + 1, dtype=self.query_start_loc.dtype, device=self.query_start_loc.device),
            seq_lens=self.seq_lens[rows],
            max_query_len=1,
            slot_mapping=self.slot_mapping[rows],
            block_table=self.block_table[rows],
            query_start_loc_host=None,
            seq_lens_host=None,
        )

    def for_ubatch(self, ubatch: UBatchSlice, attention: AttentionSlice) -> "AttentionMetadata":
        """This step's metadata restricted to one ubatch (see `slice_attention_metadata`);
        `attention` may be on the host, and is then copied to this metadata's device."""
        device = self.query_start_loc.device
        on_host = attention.query_start_loc.device.type == "cpu"
        return replace(
            self,
            query_start_loc=to_device_async(attention.query_start_loc, device),
            seq_lens=to_device_async(attention.seq_lens, device),
            query_start_loc_host=tuple(attention.query_start_loc.tolist()) if on_host else None,
            seq_lens_host=tuple(attention.seq_lens.tolist()) if on_host else None,
            max_query_len=attention.max_query_len,
            slot_mapping=self.slot_mapping[ubatch.token_slice],
            block_table=self.block_table[ubatch.request_slice],
        )


def write_to_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`cache [num_blocks, block_size, ...]`, `values [T, ...]`; rows with slot -1 are skipped
    (under a graph capture: written to `NULL_BLOCK`)."""
    flat = cache.view(-1, *cache.shape[2:])
    values = values[: slot_mapping.shape[0]].to(cache.dtype)
    # Dropping rows by a boolean mask reads the mask on the host: never inside a capture, and
    # not on a GPU (a sync per layer). There the runner reserves NULL_BLOCK for padding rows.
    if graph_capture_active() or cache.device.type != "cpu":
        null_slot = NULL_BLOCK * cache.shape[1]
        flat.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, null_slot), values)
        return
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = values[keep]


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
    if metadata.decode_only:
        if _triton_decode_applies(key_cache):
            from tandem.models.triton_decode_attention import triton_decode_attention

            return triton_decode_attention(query, key_cache, value_cache, metadata.seq_lens, metadata.block_table, scale)
        return _decode_attention(query, key_cache, value_cache, metadata, scale)
    num_tokens, num_heads, _ = query.shape
    out = query.new_zeros((num_tokens, num_heads, value_cache.shape[-1]))
    qsl, seq_lens = metadata.host_lists()
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
        q_pos = torch.arange(seq_len - (stop - start), seq_len, device=query.device).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq_len, device=query.device).unsqueeze(0) > q_pos, float("-inf"))
        out[start:stop] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out


@lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return find_spec("triton") is not None


def _triton_decode_applies(cache: torch.Tensor) -> bool:
    """A CUDA cache takes the Triton split-KV kernels (`triton_decode_attention`), which read
    each request's blocks in place up to its `seq_len`; the gather below reads the table's
    whole width (under a graph: `max_model_len`) and stays for CPU and Triton-less hosts."""
    return (
        cache.device.type == "cuda"
        and cache.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and _triton_importable()
    )


def _decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query row per request, all requests at once, no host read: gather every block of
    the block table and mask positions at or past each request's `seq_len`."""
    num_tokens, num_heads, _ = query.shape
    requests = metadata.block_table.shape[0]
    blocks = metadata.block_table.long()
    k = key_cache[blocks].flatten(1, 2)  # [R, max_blocks * block_size, Hkv, Dk]
    v = value_cache[blocks].flatten(1, 2)
    kv_heads = k.shape[2]
    group = num_heads // kv_heads
    # Grouped-query without materialising repeated K/V: heads are [kv_head, group] major.
    q = query[:requests].float().view(requests, kv_heads, group, query.shape[-1])
    scores = torch.einsum("rngd,rknd->rngk", q, k.float()) * scale
    seq_lens = metadata.seq_lens.long().view(-1, 1, 1, 1)
    positions = torch.arange(k.shape[1], device=query.device)
    # A padding request (seq_len 0) attends to its first slot, and its output is zeroed.
    scores = scores.masked_fill(positions >= seq_lens.clamp(min=1), float("-inf"))
    out = torch.einsum("rngk,rknd->rngd", scores.softmax(-1), v.float()).reshape(requests, num_heads, v.shape[-1])
    out = torch.where((seq_lens.view(-1) > 0).view(-1, 1, 1), out, 0.0).to(query.dtype)
    if requests == num_tokens:
        return out
    return torch.cat((out, out.new_zeros((num_tokens - requests, *out.shape[1:]))))
