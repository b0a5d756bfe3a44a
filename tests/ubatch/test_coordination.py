import pytest

from tandem.testing import run_distributed
from tandem.ubatch import coordinate_ubatching


def _decide(rank, world_size, cases):
    return [coordinate_ubatching(*cases[i][rank]) for i in range(len(cases))]


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
