"""The ranks' skew at each all-to-all (#31): on a host the ranks do not reach a dispatch or a
combine together, and the call completes when the last one has come. `host_link.sync_wait`
measures how much later than the ranks' mean the last rank comes (median over the calls); the
profile carries it (`sync_wait_s`) and the simulator waits that long on the comm stream at
every send, where the other ubatch's work can hide it."""

from __future__ import annotations

import math

import pytest

from tandem.simulate import simulate
from tandem.simulate.host_link import KINDS, SYNC_WAIT_FIGURE, LinkFit, sync_wait
from tandem.testing import run_distributed
from tests.support.host_profiles import given_host

#: The MoE stack's unsplit step: 4 layers, a dispatch and a combine each.
SENDS = 8


def _rank_wait(rank: int, world: int) -> float:
    # Rank 0 comes to its calls at 0, 10 and 20 s; rank 1 at 2, 10 and 23 s: the last rank
    # comes 1, 0 and 1.5 s after the ranks' mean, median 1.
    arrivals = [[0.0, 10.0, 20.0], [2.0, 10.0, 23.0]][rank]
    return sync_wait(arrivals, world)


def test_the_wait_is_the_last_ranks_lateness_over_the_mean_median_over_the_calls():
    assert run_distributed(_rank_wait, 2) == [1.0, 1.0]


def _link(wait: float) -> LinkFit:
    return LinkFit({k: 1e-3 for k in KINDS}, {k: 1e9 for k in KINDS}, {k: [(1e6, 2e-3)] for k in KINDS}, wait)


def test_the_profile_carries_a_measured_wait_and_none_without_one():
    assert given_host(small_rate=100e9, switch_s=0.0, link=_link(2e-3)).figures[SYNC_WAIT_FIGURE] == 2e-3
    assert SYNC_WAIT_FIGURE not in given_host(small_rate=100e9, switch_s=0.0, link=_link(0.0)).figures
    assert SYNC_WAIT_FIGURE not in given_host(small_rate=100e9, switch_s=0.0).figures


def _steps(wait: float, link_mbit: float | None = None) -> dict[str, float]:
    hw = given_host(small_rate=100e9, switch_s=0.0, link=_link(wait))
    sim = simulate("moe-stack", hw, ep=2, phase="prefill", tokens_per_rank=512, context=1, modes=["none", "dbo"],
                   link_mbit=link_mbit)
    return {r.mode: r.step_s for r in sim.results}


def test_without_overlap_every_send_waits_for_the_last_rank():
    """On the computing cores with no link every transfer blocks the step: 8 sends, 2 ms each
    (and DBO's 16 sends each wait too: nothing of the other ubatch runs while one blocks)."""
    free, skewed = _steps(0.0), _steps(2e-3)
    assert skewed["none"] - free["none"] == pytest.approx(SENDS * 2e-3)
    assert skewed["dbo"] - free["dbo"] == pytest.approx(2 * SENDS * 2e-3)


def test_over_a_link_the_other_ubatch_hides_the_wait():
    """Over a shaped link the wait joins the wire on the comm stream: none pays all 8, DBO,
    which computes the other ubatch meanwhile, pays less than its 16 sends' worth."""
    free, skewed = _steps(0.0, 400), _steps(2e-3, 400)
    assert skewed["none"] - free["none"] == pytest.approx(SENDS * 2e-3)
    assert 0.0 <= skewed["dbo"] - free["dbo"] < 2 * SENDS * 2e-3
    assert not math.isclose(skewed["dbo"] - free["dbo"], 2 * SENDS * 2e-3)
