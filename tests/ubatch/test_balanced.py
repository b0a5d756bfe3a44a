import pytest

from tandem.ubatch import balanced_split


def test_two_chunk_when_one_sequence_dominates():
    split = balanced_split([42, 999])
    assert (split.seq_index, split.token_index, split.two_chunk) == (1, 520, True)
    assert split.lens_a == [42, 478]
    assert split.lens_b == [521]


def test_balanced_by_sequence():
    split = balanced_split([300, 100, 200])
    assert (split.seq_index, split.token_index, split.two_chunk) == (1, 300, False)
    assert (split.lens_a, split.lens_b) == ([300], [100, 200])


def test_ties_go_to_the_later_index():
    split = balanced_split([1, 2, 1], threshold=0.0)
    assert (split.seq_index, split.token_index) == (2, 3)


def test_uniform_decode_halves():
    split = balanced_split([1] * 8)
    assert (split.seq_index, split.token_index, split.two_chunk) == (4, 4, False)


def test_single_long_sequence_is_cut_in_two():
    split = balanced_split([10])
    assert (split.seq_index, split.token_index, split.two_chunk) == (0, 5, True)
    assert (split.lens_a, split.lens_b) == ([5], [5])


def test_cut_on_a_boundary_is_not_two_chunk():
    # 1/3 is outside [0.48, 0.52] but the token midpoint (1) is the sequence boundary.
    split = balanced_split([1, 2])
    assert split.two_chunk is False
    assert (split.lens_a, split.lens_b) == ([1], [2])


def test_no_two_chunk_when_part_a_would_have_more_sequences_than_tokens():
    split = balanced_split([0, 0, 0, 0, 3])
    assert split.two_chunk is False
    assert sum(split.lens_a) + sum(split.lens_b) == 3


def test_lower_threshold_accepts_less_balanced_sequence_splits():
    assert balanced_split([60, 40]).two_chunk is True
    assert balanced_split([60, 40], threshold=0.4).two_chunk is False


def test_empty_and_bad_input():
    assert balanced_split([]) == balanced_split([]).__class__(0, 0, False, [], [])
    with pytest.raises(ValueError, match="threshold"):
        balanced_split([1, 2], threshold=0.7)
    with pytest.raises(ValueError, match="non-negative"):
        balanced_split([1, -2])
