import pytest
import torch

from tandem.ubatch import slice_attention_metadata, split_by_tokens


def test_prefill_cut_across_the_boundary():
    slices = split_by_tokens([1, 1, 10, 1, 1])
    first, second = slice_attention_metadata([0, 1, 2, 12, 13, 14], [64, 96, 512, 32, 48], slices)
    assert first.query_start_loc.tolist() == [0, 1, 2, 7]
    assert first.seq_lens.tolist() == [64, 96, 507]
    assert first.max_query_len == 5
    assert second.query_start_loc.tolist() == [0, 5, 6, 7]
    assert second.seq_lens.tolist() == [512, 32, 48]
    assert second.max_query_len == 5


def test_request_cut_three_ways_sees_its_growing_prefix():
    # One 9-token prefill on top of 11 cached tokens: seq_len 20.
    parts = slice_attention_metadata([0, 9], [20], split_by_tokens([9], num_ubatches=3))
    assert [p.seq_lens.tolist() for p in parts] == [[14], [17], [20]]
    assert [p.query_start_loc.tolist() for p in parts] == [[0, 3]] * 3


def test_padding_tokens_belong_to_no_request():
    slices = split_by_tokens([1] * 6, num_tokens_padded=8)
    first, second = slice_attention_metadata(list(range(7)), [5] * 6, slices)
    assert second.query_start_loc.tolist() == [0, 1, 2]
    assert second.seq_lens.tolist() == [5, 5]


def test_tensor_input_keeps_device_and_int32():
    qsl = torch.tensor([0, 1, 2, 3, 4])
    parts = slice_attention_metadata(qsl, torch.tensor([7, 8, 9, 10]), split_by_tokens([1] * 4))
    assert parts[0].query_start_loc.dtype == torch.int32
    assert parts[1].seq_lens.tolist() == [9, 10]


def test_all_padding_ubatch_has_no_requests():
    slices = split_by_tokens([1, 1], num_tokens_padded=8)
    parts = slice_attention_metadata([0, 1, 2], [3, 4], slices)
    assert parts[1].query_start_loc.tolist() == [0]
    assert parts[1].seq_lens.tolist() == []
    assert parts[1].max_query_len == 0


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="R\\+1"):
        slice_attention_metadata([0, 1, 2], [3], split_by_tokens([1, 1]))


def test_decreasing_query_start_loc_is_rejected():
    with pytest.raises(ValueError, match="non-decreasing"):
        slice_attention_metadata([0, 2, 1], [3, 4], split_by_tokens([2, 1]))
