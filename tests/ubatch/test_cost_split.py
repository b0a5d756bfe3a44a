import pytest

from tandem.ubatch import (
    UBatchSlice,
    attention_work,
    slice_attention_metadata,
    slices_at_cuts,
    split_by_cost,
    split_by_tokens,
)


def test_attention_work_counts_causal_query_key_pairs():
    # 3 new tokens over 10 cached: 11 + 12 + 13 keys; one decode token over 4 cached: 5.
    assert attention_work([3, 1], [10, 4]) == 36 + 5


def test_uniform_decode_cuts_where_the_token_midpoint_is():
    assert split_by_cost([1] * 8, [100] * 8) == split_by_tokens([1] * 8)
    assert split_by_cost([1] * 9, [7] * 9, num_ubatches=3) == split_by_tokens([1] * 9, num_ubatches=3)


def test_without_attention_weight_it_is_the_token_split():
    counts, contexts = [5, 300, 7, 20], [0, 900, 3, 0]
    assert split_by_cost(counts, contexts, attention_weight=0.0) == split_by_tokens(counts)


def test_long_request_moves_the_cut_into_it():
    # One 512-token prefill first, then 96 short ones: its late tokens attend over many
    # more keys, so the first ubatch must hold fewer than half of the tokens.
    counts, contexts = [512] + [8] * 96, [0] * 97
    first, second = split_by_cost(counts, contexts, attention_weight=1 / 64)
    assert first.token_slice.stop < 512 < split_by_tokens(counts)[0].token_slice.stop
    assert first.request_slice == slice(0, 1) and second.request_slice == slice(0, 97)  # it straddles
    work = lambda sl: sum(1 + (i + 1) / 64 for i in range(sl.token_slice.start, min(sl.token_slice.stop, 512))) + max(
        0, sl.token_slice.stop - max(sl.token_slice.start, 512)
    ) * (1 + 4.5 / 64)
    assert work(first) == pytest.approx(work(second), rel=0.01)


def test_straddling_request_keeps_the_attention_metadata_contract():
    counts, contexts = [1, 40, 1], [30, 0, 50]
    slices = split_by_cost(counts, contexts, attention_weight=0.5)
    cut = slices[0].token_slice.stop
    assert 1 < cut < 41  # inside the 40-token prefill
    seq_lens = [c + n for c, n in zip(contexts, counts)]
    first, second = slice_attention_metadata([0, 1, 41, 42], seq_lens, slices)
    # Its first part sees only the keys written so far; its second part the full length.
    assert first.seq_lens.tolist() == [31, cut - 1]
    assert second.seq_lens.tolist() == [40, 51]
    assert first.query_start_loc.tolist() == [0, 1, cut]
    assert second.query_start_loc.tolist() == [0, 41 - cut, 42 - cut]


def test_padding_is_costed_and_every_ubatch_has_a_token():
    slices = split_by_cost([1, 1], [0, 0], num_ubatches=2, num_tokens_padded=6)
    assert [s.token_slice for s in slices] == [slice(0, 3), slice(3, 6)]
    assert slices[1].request_slice == slice(2, 2)  # padding only
    tiny = split_by_cost([2], [1000], num_ubatches=2, attention_weight=10.0)
    assert [s.num_tokens for s in tiny] == [1, 1]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="context lengths"):
        split_by_cost([1, 2], [0])
    with pytest.raises(ValueError, match="non-empty ubatches"):
        split_by_cost([1], [0], num_ubatches=2)
    with pytest.raises(ValueError, match="attention_weight"):
        split_by_cost([4], [0], attention_weight=-1)
    with pytest.raises(ValueError, match="non-decreasing"):
        slices_at_cuts([4], [3, 2], 4)
    assert slices_at_cuts([2, 2], [2], 4) == [UBatchSlice(slice(0, 1), slice(0, 2)), UBatchSlice(slice(1, 2), slice(2, 4))]
