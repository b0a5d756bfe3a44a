from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.models import paged_attention, write_to_cache
from tandem.platform import cpu_kernels
from tandem.worker import BlockAllocator, ScheduledChunk, blocks_needed, build_step_inputs
from tandem.ubatch import slice_attention_metadata, split_by_tokens

HQ, HKV, D, BS = 4, 2, 8, 4


def dense_causal(q, k, v):
    """q [L, Hq, D] are the last rows of a sequence whose k/v [S, Hkv, D] are complete."""
    group = HQ // HKV
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    S, L = k.shape[0], q.shape[0]
    mask = torch.arange(S).unsqueeze(0) <= torch.arange(S - L, S).unsqueeze(1)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=D**-0.5
    ).transpose(0, 1)


def setup(lengths, computed):
    torch.manual_seed(0)
    allocator = BlockAllocator(32)
    k_cache, v_cache = torch.zeros(32, BS, HKV, D), torch.zeros(32, BS, HKV, D)
    full_k = [torch.randn(n, HKV, D) for n in lengths]
    full_v = [torch.randn(n, HKV, D) for n in lengths]
    chunks = []
    for n, c, k, v in zip(lengths, computed, full_k, full_v):
        blocks = allocator.allocate(blocks_needed(n, BS))
        chunks.append(ScheduledChunk(list(range(n - c)), c, blocks))
        # Pre-fill the cached prefix as an earlier step would have.
        for p in range(c):
            k_cache[blocks[p // BS], p % BS] = k[p]
            v_cache[blocks[p // BS], p % BS] = v[p]
    inputs = build_step_inputs(chunks, BS)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, computed)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, computed)])
    write_to_cache(k_cache, new_k, inputs.attn_metadata.slot_mapping)
    write_to_cache(v_cache, new_v, inputs.attn_metadata.slot_mapping)
    q = torch.randn(inputs.num_tokens, HQ, D)
    expected = torch.cat(
        [dense_causal(q[s:e], k, v) for (s, e), k, v in zip(zip(inputs.attn_metadata.query_start_loc[:-1].tolist(), inputs.attn_metadata.query_start_loc[1:].tolist()), full_k, full_v)]
    )
    return inputs, q, k_cache, v_cache, expected


def test_mixed_prefill_and_decode_match_dense_attention():
    inputs, q, k_cache, v_cache, expected = setup([7, 5, 9], [0, 4, 8])  # prefill, chunked prefill, decode
    out = paged_attention(q, k_cache, v_cache, inputs.attn_metadata, D**-0.5)
    torch.testing.assert_close(out, expected)


def test_ubatch_slices_give_the_same_rows():
    inputs, q, k_cache, v_cache, expected = setup([1, 1, 10, 1, 1], [0, 0, 0, 0, 0])
    slices = split_by_tokens(inputs.num_scheduled_tokens)
    parts = slice_attention_metadata(inputs.attn_metadata.query_start_loc, inputs.attn_metadata.seq_lens, slices)
    outs = [
        paged_attention(q[ub.token_slice], k_cache, v_cache, inputs.attn_metadata.for_ubatch(ub, part), D**-0.5)
        for ub, part in zip(slices, parts)
    ]
    # The request cut across the boundary attends in its first part only to the prefix it has.
    torch.testing.assert_close(torch.cat(outs), expected)


def test_padding_rows_write_and_read_nothing():
    allocator = BlockAllocator(4)
    inputs = build_step_inputs([ScheduledChunk([5, 6], 0, allocator.allocate(1))], BS, num_tokens_padded=4)
    assert inputs.attn_metadata.slot_mapping.tolist()[2:] == [-1, -1]
    cache = torch.zeros(4, BS, 1, 1)
    write_to_cache(cache, torch.ones(4, 1, 1), inputs.attn_metadata.slot_mapping)
    assert cache.sum() == 2
    out = paged_attention(torch.randn(4, 1, 1), cache, cache, inputs.attn_metadata, 1.0)
    assert torch.count_nonzero(out[2:]) == 0


def _decode_batch(lengths, dtype=torch.float32, width=None, dv=D, hkv=HKV, hq=HQ, shared_value=False):
    """Decode rows over caches filled at random; `width` pads every block table row."""
    torch.manual_seed(1)
    allocator = BlockAllocator(64)
    chunks = []
    for n in lengths:
        blocks = allocator.allocate(width or blocks_needed(n, BS))
        chunks.append(ScheduledChunk([1], n - 1, blocks))
    inputs = build_step_inputs(chunks, BS)
    k_cache = torch.randn(64, BS, hkv, D).to(dtype)
    v_cache = k_cache[..., :dv] if shared_value else torch.randn(64, BS, hkv, dv).to(dtype)
    q = torch.randn(len(lengths), hq, D).to(dtype)
    table = inputs.attn_metadata.block_table.long()
    expected = []
    for r, n in enumerate(lengths):
        k = k_cache[table[r]].flatten(0, 1)[:n].float()
        v = v_cache[table[r]].flatten(0, 1)[:n].float()
        g = hq // hkv
        expected.append(F.scaled_dot_product_attention(
            q[r : r + 1].float().transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1),
            v.repeat_interleave(g, 1).transpose(0, 1), scale=D**-0.5).transpose(0, 1))
    return inputs.attn_metadata, q, k_cache, v_cache, torch.cat(expected)


def test_decode_reads_up_to_each_length_whatever_the_table_width():
    narrow = _decode_batch([3, 9, 17])
    wide = _decode_batch([3, 9, 17], width=12)  # a table as wide as a captured graph's
    for metadata, q, k_cache, v_cache, expected in (narrow, wide):
        assert metadata.decode_only
        torch.testing.assert_close(paged_attention(q, k_cache, v_cache, metadata, D**-0.5), expected)
    # Without host lengths (as under a capture) it reads the whole table: same values.
    metadata, q, k_cache, v_cache, expected = wide
    no_host = replace(metadata, seq_lens_host=None, query_start_loc_host=None)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, no_host, D**-0.5), expected)


def _largest_new_tensor(fn) -> int:
    class Sizes(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        Sizes.largest = max(Sizes.largest, t.numel())
            return out

    with Sizes():
        fn()
    return Sizes.largest


def test_decode_work_follows_the_lengths_not_the_table_width():
    from tandem.models.paged_attention import _decode_attention

    gathered, in_place = [], []
    for width in (5, 16):
        metadata, q, k_cache, v_cache, _ = _decode_batch([3, 9, 17], width=width)
        gathered.append(_largest_new_tensor(lambda: _decode_attention(q, k_cache, v_cache, metadata, D**-0.5, in_place=False)))
        in_place.append(_largest_new_tensor(lambda: paged_attention(q, k_cache, v_cache, metadata, D**-0.5)))
    assert gathered[0] == gathered[1] == 3 * 5 * BS * HKV * D  # 3 requests x the 5 blocks the longest one uses
    if cpu_kernels.available():  # tandem's kernel reads the cache in place: no copy of it at all
        assert in_place[0] == in_place[1] == 3 * HQ * D


def test_bf16_decode_and_prefill_stay_in_bf16_close_to_fp32():
    metadata, q, k_cache, v_cache, expected = _decode_batch([5, 12], dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, metadata, D**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    inputs, q, k_cache, v_cache, expected = setup([7, 5, 9], [0, 4, 8])
    out = paged_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), inputs.attn_metadata, D**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_latent_cache_whose_values_are_the_keys_first_channels():
    # MLA's latent cache: one KV head, V a prefix view of K, many query heads.
    metadata, q, k_cache, v_cache, expected = _decode_batch([6, 11], dv=5, hkv=1, hq=4, shared_value=True)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, metadata, D**-0.5), expected)


def test_equal_length_prefills_chunked_prefills_decodes_and_padding_in_one_step():
    # Two prefills of 6 (one group), a chunked prefill of 6 over a cached prefix, decodes, padding.
    inputs, q, k_cache, v_cache, expected = setup([6, 6, 10, 4, 9, 6], [0, 0, 4, 3, 8, 0])
    out = paged_attention(q, k_cache, v_cache, inputs.attn_metadata, D**-0.5)
    torch.testing.assert_close(out, expected)
    padded = torch.cat((q, torch.randn(3, HQ, D)))
    metadata = replace(inputs.attn_metadata, slot_mapping=torch.cat((inputs.attn_metadata.slot_mapping,
                                                                      torch.full((3,), -1))))
    out = paged_attention(padded, k_cache, v_cache, metadata, D**-0.5)
    torch.testing.assert_close(out[: q.shape[0]], expected)
    assert torch.count_nonzero(out[q.shape[0] :]) == 0


def test_decode_padding_request_of_length_zero_gives_zeros():
    metadata, q, k_cache, v_cache, expected = _decode_batch([4, 7])
    metadata = replace(metadata, seq_lens=torch.tensor([4, 0], dtype=torch.int32), seq_lens_host=None,
                       query_start_loc_host=None)
    out = paged_attention(q, k_cache, v_cache, metadata, D**-0.5)
    torch.testing.assert_close(out[0], expected[0])
    assert torch.count_nonzero(out[1]) == 0
