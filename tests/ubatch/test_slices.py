import pytest

from tandem.ubatch import UBatchSlice, is_last_ubatch_empty, split_by_tokens


def test_uniform_decode_splits_in_half():
    assert split_by_tokens([1] * 8) == [
        UBatchSlice(slice(0, 4), slice(0, 4)),
        UBatchSlice(slice(4, 8), slice(4, 8)),
    ]


def test_request_straddling_the_cut_is_in_both_ubatches():
    first, second = split_by_tokens([1, 1, 10, 1, 1])
    assert (first.request_slice, first.token_slice) == (slice(0, 3), slice(0, 7))
    assert (second.request_slice, second.token_slice) == (slice(2, 5), slice(7, 14))
    assert (first.num_tokens, first.num_requests) == (7, 3)
    assert (second.num_tokens, second.num_requests) == (7, 3)


def test_three_ubatches_cover_every_token_once():
    slices = split_by_tokens([3, 5, 1, 7], num_ubatches=3)
    assert [s.token_slice for s in slices] == [slice(0, 5), slice(5, 10), slice(10, 16)]
    assert [s.request_slice for s in slices] == [slice(0, 2), slice(1, 4), slice(3, 4)]


def test_padding_extends_the_last_slice_only():
    slices = split_by_tokens([1] * 6, num_tokens_padded=8)
    assert [s.token_slice for s in slices] == [slice(0, 4), slice(4, 8)]
    # The last ubatch holds the two real requests 4 and 5 plus two padding tokens.
    assert slices[1].request_slice == slice(4, 6)


def test_explicit_split_point():
    slices = split_by_tokens([4, 4, 4], split_point=3)
    assert [s.token_slice for s in slices] == [slice(0, 3), slice(3, 12)]
    assert [s.request_slice for s in slices] == [slice(0, 1), slice(0, 3)]


def test_all_padding_ubatch_gets_an_empty_request_slice():
    slices = split_by_tokens([1, 1], num_tokens_padded=8)
    assert slices[1] == UBatchSlice(slice(2, 2), slice(4, 8))
    assert slices[1].num_requests == 0


def test_empty_batch_gives_empty_slices():
    assert split_by_tokens([]) == [UBatchSlice(slice(0, 0), slice(0, 0))] * 2


def test_one_request_one_token():
    assert split_by_tokens([1]) == [
        UBatchSlice(slice(1, 1), slice(0, 0)),
        UBatchSlice(slice(0, 1), slice(0, 1)),
    ]


def test_one_long_request_is_in_every_ubatch():
    slices = split_by_tokens([9], num_ubatches=3)
    assert [s.request_slice for s in slices] == [slice(0, 1)] * 3
    assert [s.num_tokens for s in slices] == [3, 3, 3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_scheduled_tokens": [1, -1]}, "non-negative"),
        ({"num_scheduled_tokens": [4], "num_tokens_padded": 3}, "smaller than"),
        ({"num_scheduled_tokens": [4], "num_ubatches": 0}, "num_ubatches"),
        ({"num_scheduled_tokens": [4], "split_point": 5}, "split_point"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_by_tokens(**kwargs)


@pytest.mark.parametrize(
    "num_tokens, padded, n, expected",
    [
        (256, 256, 2, False),
        (200, 256, 2, False),
        (128, 256, 2, True),
        (129, 256, 2, False),
        (0, 0, 2, True),
        (10, 12, 3, False),
        (8, 12, 3, True),
    ],
)
def test_is_last_ubatch_empty(num_tokens, padded, n, expected):
    assert is_last_ubatch_empty(num_tokens, padded, n) is expected
