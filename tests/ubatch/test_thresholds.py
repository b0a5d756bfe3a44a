import pytest

from tandem.ubatch import check_ubatch_thresholds


@pytest.mark.parametrize(
    "num_tokens, uniform_decode, expected",
    [(31, True, False), (32, True, True), (100, False, False), (511, False, False), (512, False, True), (0, True, False)],
)
def test_decode_and_prefill_thresholds(num_tokens, uniform_decode, expected):
    assert check_ubatch_thresholds(num_tokens, uniform_decode, 32, 512) is expected


def test_zero_threshold_always_ubatches():
    assert check_ubatch_thresholds(0, True, 0, 0)


def test_negative_token_count_is_rejected():
    with pytest.raises(ValueError, match="num_tokens"):
        check_ubatch_thresholds(-1, True, 32, 512)
