"""The ranks' skew at each all-to-all (#31): on a host the ranks do not reach a dispatch or a
combine together, and the call completes when the last one has come. `host_link.sync_wait`
measures how much later than the ranks' mean the last rank comes, median over the calls
(`benchmarks/real_links.py` logs it per job; the simulator does not play it: rank 0's timed
calls, which gloo's line is fitted to, already hold its waits for the peer)."""

from __future__ import annotations

import pytest

from tandem.simulate.host_link import sync_wait
from tandem.testing import DistributedTestError, run_distributed


def _rank_wait(rank: int, world: int) -> float:
    # Rank 0 comes to its calls at 0, 10 and 20 s; rank 1 at 2, 10 and 23 s: the last rank
    # comes 1, 0 and 1.5 s after the ranks' mean, median 1.
    arrivals = [[0.0, 10.0, 20.0], [2.0, 10.0, 23.0]][rank]
    return sync_wait(arrivals, world)


def test_the_wait_is_the_last_ranks_lateness_over_the_mean_median_over_the_calls():
    assert run_distributed(_rank_wait, 2) == [1.0, 1.0]


def _rank_unequal(rank: int, world: int) -> float:
    return sync_wait([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0]][rank], world)


def test_ranks_that_made_different_numbers_of_calls_are_refused():
    with pytest.raises(DistributedTestError, match="different numbers of calls"):
        run_distributed(_rank_unequal, 2)
