"""Varlen attention over a paged KV cache, for batches that mix prefill and decode.

A step's tokens are laid out request after request; request r owns query rows
`query_start_loc[r]:query_start_loc[r+1]`, which are the *last* `q_len` positions of its
`seq_lens[r]` tokens (the earlier ones are already in the cache). Each token's new K/V is
written to cache slot `slot_mapping[t]` (block * block_size + offset), and request r reads
its whole sequence back through `block_table[r]`. Rows past `num_actual_tokens` are
padding: they write nothing and attend to nothing.

Decode rows on the CPU read the cache in place (tandem's kernel, `cpu_kernels`). Otherwise
attention is `scaled_dot_product_attention` in the cache dtype over each request's blocks,
gathered once (`index_select`) up to the longest request of the call, never to the block
table's width when the host knows the lengths. A *decode-only* batch (every request one
query row, `decode_only=True`) is one call with no host reads: under a capture it reads the
whole table and masks by the device `seq_lens`, so it can be captured in a graph. Mixed
batches make one call per run of consecutive requests with the same query length (see
`varlen_runs`; MLA's per-head prefill takes the same runs, `mla_prefill.py`). Under a graph capture, cache writes cannot
drop padding rows by a boolean mask (a data-dependent shape); they write them into
`NULL_BLOCK` instead, which the runner's block allocator never hands out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tandem.platform import cpu_kernels
from tandem.platform.triton_utils import use_triton
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
        seq_lens_host = None if self.seq_lens_host is None else self.seq_lens_host[rows]
        return replace(
            self,
            query_start_loc=torch.arange(n + 1, dtype=self.query_start_loc.dtype, device=self.query_start_loc.device),
            seq_lens=self.seq_lens[rows],
            max_query_len=1,
            slot_mapping=self.slot_mapping[rows],
            block_table=self.block_table[rows],
            query_start_loc_host=None if seq_lens_host is None else tuple(range(n + 1)),
            seq_lens_host=seq_lens_host,
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
    query_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `query [T, Hq, Dk]` over each request's cached K `[.., Hkv, Dk]`
    and V `[.., Hkv, Dv]` (grouped-query when Hq > Hkv); returns `[T, Hq, Dv]`, zero on
    padding rows. The caller has already written this step's K/V to the cache. Decode rows
    on the CPU read the cache in place through tandem's kernel (`cpu_kernels.decode_attention`)
    where it is built, outside graph captures (a `CpuGraph` records ATen ops only).
    `query_rope`: the query's last columns given apart (MLA's rotated part): the Triton
    decode kernel reads the two parts where they are; the other paths concatenate them."""
    if metadata.decode_only and _triton_decode_applies(key_cache):
        from tandem.models.triton_decode_attention import triton_decode_attention

        return triton_decode_attention(
            query, key_cache, value_cache, metadata.seq_lens, metadata.block_table, scale, query_rope=query_rope
        )
    if query_rope is not None:
        query = torch.cat((query, query_rope), dim=-1)
    if metadata.decode_only:
        in_place = _in_place_decode_applies(query, key_cache, value_cache)
        return _decode_attention(query, key_cache, value_cache, metadata, scale, in_place=in_place)
    return _varlen_attention(query, key_cache, value_cache, metadata, scale)


def _in_place_decode_applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    return cpu_kernels.takes(query, key_cache, value_cache)


def _triton_decode_applies(cache: torch.Tensor) -> bool:
    """A CUDA cache takes the Triton split-KV kernels (`triton_decode_attention`), which read
    each request's blocks in place up to its `seq_len`; the gather below reads the table's
    whole width (under a graph: `max_model_len`) and stays for CPU and Triton-less hosts."""
    return use_triton(cache) and cache.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    in_place: bool = False,
) -> torch.Tensor:
    """One query row per request, all requests at once. With the host's `seq_lens` (eager)
    it reads the blocks up to the longest request; without them (a captured graph, whose
    table is as wide as the longest request could be) it reads every block of the table and
    masks by the device `seq_lens`, with no host read."""
    num_tokens, num_heads, _ = query.shape
    requests = metadata.num_requests
    block_table = metadata.block_table
    if metadata.seq_lens_host is not None and not graph_capture_active():
        block_table = block_table[:, : _blocks_for(max(metadata.seq_lens_host, default=0), metadata.block_size)]
    out = None
    if in_place:
        out = cpu_kernels.decode_attention(query[:requests], key_cache, value_cache, block_table, metadata.seq_lens, scale)
    if out is None:
        out = _attend(query[:requests].unsqueeze(1), key_cache, value_cache, block_table, metadata.seq_lens, scale)
        # A padding request (seq_len 0) attended to its first slot only: its output is zeroed.
        out = torch.where((metadata.seq_lens > 0).view(-1, 1, 1), out.squeeze(1), 0.0)
    if requests == num_tokens:
        return out
    return torch.cat((out, out.new_zeros((num_tokens - requests, *out.shape[1:]))))


@dataclass(frozen=True)
class VarlenRun:
    """Consecutive requests `[first, end)` with the same query length: query rows `[start,
    stop)`, `block_table` cut to the blocks the longest of them uses, their device `seq_lens`.
    `from_start`: each request's sequence is its query (a prefill with nothing cached)."""

    first: int
    end: int
    length: int
    start: int
    stop: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    from_start: bool

    @property
    def requests(self) -> int:
        return self.end - self.first


def varlen_runs(metadata: AttentionMetadata) -> list[VarlenRun]:
    """A step's requests as runs of equal query length (a step's decodes are one run,
    equal-length prefills admitted together another); requests with no query rows are left
    out. Host lists only: no index tensor is built, nothing is copied to the device."""
    qsl, seq_lens = metadata.host_lists()
    spans: list[list[int]] = []  # [first request, end request, query length]
    for r in range(len(seq_lens)):
        length = qsl[r + 1] - qsl[r]
        if spans and spans[-1][1] == r and spans[-1][2] == length:
            spans[-1][1] = r + 1
        elif length:
            spans.append([r, r + 1, length])
    runs = []
    for first, end, length in spans:
        lens = seq_lens[first:end]
        block_table = metadata.block_table[first:end, : _blocks_for(max(lens), metadata.block_size)]
        runs.append(VarlenRun(first, end, length, qsl[first], qsl[end], block_table, metadata.seq_lens[first:end],
                              from_start=all(n == length for n in lens)))
    return runs


def attend_run(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, run: VarlenRun, scale: float
) -> torch.Tensor:
    """One run's attention: `query [run rows, Hq, Dk]` -> `[run rows, Hq, Dv]`. A run of
    decodes on the CPU reads the cache in place where tandem's kernel takes it."""
    if run.length == 1 and _in_place_decode_applies(query, key_cache, value_cache):
        rows = cpu_kernels.decode_attention(query, key_cache, value_cache, run.block_table, run.seq_lens, scale)
        if rows is not None:
            return rows
    group_query = query.view(run.requests, run.length, *query.shape[1:])
    out = _attend(group_query, key_cache, value_cache, run.block_table, run.seq_lens, scale, from_start=run.from_start)
    return out.flatten(0, 1)


def assemble_runs(
    attended: list[tuple[VarlenRun, torch.Tensor]], like: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """The step's output `shape` (`[num_tokens, ...]`, `like`'s dtype and device) from each
    run's rows; rows no run covers (padding) are zero."""
    if len(attended) == 1 and (attended[0][0].start, attended[0][0].stop) == (0, shape[0]):
        return attended[0][1]
    out = like.new_zeros(shape)
    for run, rows in attended:
        out[run.start : run.stop] = rows
    return out


def _varlen_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """One attention call per run of consecutive requests with the same query length
    (`varlen_runs`), each over the blocks its longest request uses."""
    num_tokens, num_heads, _ = query.shape
    attended = [(run, attend_run(query[run.start : run.stop], key_cache, value_cache, run, scale))
                for run in varlen_runs(metadata)]
    return assemble_runs(attended, query, (num_tokens, num_heads, value_cache.shape[-1]))


def _attend(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, from_start: bool = False,
) -> torch.Tensor:
    """`query [G, L, Hq, Dk]`: request g's last L positions of its `seq_lens[g]` tokens
    (cached through `block_table [G, W]`); returns `[G, L, Hq, Dv]`. Reads `W` blocks per
    request in the cache dtype; no host read. `from_start`: every `seq_lens[g]` is L (a
    prefill with nothing cached before), so plain causal attention needs no mask."""
    k, v = _gather(key_cache, value_cache, block_table)
    return attend_gathered(query, k, v, seq_lens, scale, from_start)


def attend_gathered(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    from_start: bool = False,
) -> torch.Tensor:
    """`_attend` over keys and values already gathered, `[G, S, Hkv, D]` (S at least each
    `seq_lens[g]`; with `from_start`, at least L: the first L are used)."""
    length = query.shape[1]
    if from_start:
        return _sdpa(query, key[:, :length], value[:, :length], None, scale)
    # Query i of request g sees positions up to seq_len - L + i (at least position 0).
    last_visible = seq_lens.long().clamp(min=1).view(-1, 1) - length + torch.arange(length, device=query.device)
    mask = torch.arange(key.shape[1], device=query.device).view(1, 1, -1) <= last_visible.unsqueeze(-1)
    return _sdpa(query, key, value, mask.unsqueeze(1), scale)


def _gather(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's blocks, `[G, W * block_size, Hkv, D]`. A value cache that is the first
    channels of the key cache (MLA's latent cache) is sliced from the gathered keys, not
    gathered twice."""
    k = gather_blocks(key_cache, block_table)
    if _is_prefix_view(value_cache, key_cache):
        return k, k[..., : value_cache.shape[-1]]
    return k, gather_blocks(value_cache, block_table)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The cache rows of each request's blocks, `[G, W * block_size, ...]` for `block_table [G, W]`."""
    requests, width = block_table.shape
    rows = cache.index_select(0, block_table.reshape(-1).long())
    return rows.view(requests, width * cache.shape[1], *cache.shape[2:])


def _is_prefix_view(value_cache: torch.Tensor, key_cache: torch.Tensor) -> bool:
    base = key_cache if key_cache._base is None else key_cache._base
    return (
        value_cache._base is base
        and value_cache.storage_offset() == key_cache.storage_offset()
        and value_cache.shape[:-1] == key_cache.shape[:-1]
        and value_cache.stride() == key_cache.stride()
    )


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`query [G, L, Hq, D]`, `key`/`value [G, S, Hkv, D]` (head-minor, as the cache stores
    them) -> `[G, L, Hq, Dv]`; `mask` None means causal from position 0."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=query.shape[2] != key.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return max(1, -(-num_tokens // block_size))
