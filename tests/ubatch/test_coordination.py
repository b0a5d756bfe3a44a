import pytest

from tandem.testing import run_distributed
from tandem.ubatch import coordinate_ubatching


def _decide(rank, world_size, cases):
    return [coordinate_ubatching(*cases[i][rank]) for i in range(len(cases))]


@pytest.mark.slow
def test_two_gloo_ranks_agree():
    cases = [
        [(256, True), (256, True)],
        [(200, True), (256, True)],
        [(256, True), (256, False)],
        [(10, True), (256, True)],  # rank 0's last ubatch would be pure padding
        [(0, False), (0, False)],
        [(0, False), (96, True)],  # an idle rank follows the busy rank's wish
        [(0, False), (96, False)],
    ]
    per_rank = run_distributed(_decide, 2, cases, timeout_s=90)
    assert per_rank[0] == per_rank[1]
    both, uneven, one_refuses, too_small, idle, one_idle, one_idle_refuses = per_rank[0]
    assert (both.should_ubatch, both.num_tokens_padded, both.num_tokens_per_rank) == (True, 256, [256, 256])
    assert (uneven.should_ubatch, uneven.num_tokens_padded, uneven.num_tokens_per_rank) == (True, 256, [200, 256])
    assert one_refuses.should_ubatch is False
    assert (too_small.should_ubatch, too_small.num_tokens_padded) == (False, 256)
    assert (idle.should_ubatch, idle.num_tokens_padded) == (False, 0)
    assert (one_idle.should_ubatch, one_idle.num_tokens_padded) == (True, 96)
    assert one_idle_refuses.should_ubatch is False


def test_single_process_without_a_group():
    decision = coordinate_ubatching(64, True)
    assert (decision.should_ubatch, decision.num_tokens_padded, decision.num_tokens_per_rank) == (True, 64, [64])
    assert coordinate_ubatching(1, True).should_ubatch is False
    assert coordinate_ubatching(64, True, num_ubatches=4).should_ubatch is True


def test_negative_tokens_rejected():
    with pytest.raises(ValueError, match="num_tokens"):
        coordinate_ubatching(-1, True)


def _decide_with_predictions(rank, world_size, cases):
    return [coordinate_ubatching(n, True, predicted_s=p) for n, p in cases[rank]]


@pytest.mark.slow
def test_predictions_ride_in_the_same_all_reduce_and_the_slowest_busy_rank_counts():
    inf = float("inf")
    cases = [
        [(64, [0.010, 0.008]), (0, [0.5, 0.5]), (64, [0.004, inf])],
        [(64, [0.012, 0.006]), (32, [0.001, 0.001]), (64, [0.005, 0.003])],
    ]
    per_rank = run_distributed(_decide_with_predictions, 2, cases, timeout_s=90)
    assert per_rank[0] == per_rank[1]
    both, one_idle, one_unknown = per_rank[0]
    assert both.predicted_s == pytest.approx([0.012, 0.008])
    assert one_idle.predicted_s == pytest.approx([0.001, 0.001])  # the idle rank's guess is ignored
    assert one_unknown.predicted_s[0] == pytest.approx(0.005) and one_unknown.predicted_s[1] == inf


def test_fits_checks_each_ubatch_count():
    decision = coordinate_ubatching(5, True, predicted_s=[0.001])
    assert decision.predicted_s == pytest.approx([0.001])
    assert decision.fits(2) and decision.fits(5) and not decision.fits(6)
    assert coordinate_ubatching(5, True).predicted_s is None


def _decide_with_prefills(rank, world_size, cases):
    return [coordinate_ubatching(n, True, prefills=p, predicted_s=[0.001]) for n, p in cases[rank]]


@pytest.mark.slow
def test_whether_any_rank_prefills_rides_in_the_same_all_reduce():
    """TBO's strategy (decode or prefill) must be the same on every DP rank: the ranks learn
    whether any of them prefills from the one all-reduce that agrees on the split."""
    cases = [[(64, False), (64, True), (0, False)], [(64, False), (64, False), (32, True)]]
    per_rank = run_distributed(_decide_with_prefills, 2, cases, timeout_s=90)
    assert per_rank[0] == per_rank[1]
    assert [d.any_rank_prefills for d in per_rank[0]] == [False, True, True]
    assert [d.predicted_s for d in per_rank[0]] == [pytest.approx([0.001])] * 3
    assert coordinate_ubatching(8, True, prefills=True).any_rank_prefills is True
