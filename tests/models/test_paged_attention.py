import torch
import torch.nn.functional as F

from tandem.models import paged_attention, write_to_cache
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
