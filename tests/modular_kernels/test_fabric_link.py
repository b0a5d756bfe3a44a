"""The link queue: a transfer finishes at max(issue, link free) + latency + bytes /
bandwidth, sends and receives alike, so transfers in flight together share the link."""

import pytest

from tandem.modular_kernels import FabricModel
from tandem.modular_kernels.fabric import LinkQueue

# 100 µs + bytes / 1 GB/s: 1 MB takes 1.1 ms.
LATENCY_S, BYTES_PER_S, MB = 100e-6, 1e9, 1_000_000


def fabric() -> FabricModel:
    return FabricModel(LATENCY_S, BYTES_PER_S)


def test_two_overlapping_transfers_share_the_link():
    f = fabric()
    first = f.start(MB, issued=10.0)
    second = f.start(MB, issued=10.0005)  # issued while the first holds the link
    assert first == pytest.approx(10.0 + 1.1e-3)
    # Queued behind the first, then its own latency + bytes / bandwidth: not 10.0005 + 1.1 ms.
    assert second == pytest.approx(first + 1.1e-3)


def test_back_to_back_transfers_do_not_wait():
    f = fabric()
    first = f.start(MB, issued=10.0)
    second = f.start(MB // 2, issued=first + 1e-3)  # the link is free again
    assert second == pytest.approx(first + 1e-3 + LATENCY_S + 0.5e-3)


def test_send_and_receive_share_one_queue():
    f = fabric()
    send = f.start(MB, 0, issued=5.0)
    receive = f.start(0, 2 * MB, issued=5.0)
    assert send == pytest.approx(5.0 + 1.1e-3)
    assert receive == pytest.approx(send + LATENCY_S + 2e-3)


def test_an_exchange_holds_the_link_for_its_larger_direction():
    # Full duplex: sending 1 MB while receiving 2 MB takes as long as the 2 MB alone.
    assert fabric().start(MB, 2 * MB, issued=0.0) == pytest.approx(LATENCY_S + 2e-3)


def test_each_model_instance_has_its_own_link_and_equality_ignores_it():
    a, b = fabric(), fabric()
    a.start(MB, issued=0.0)
    assert b.start(MB, issued=0.0) == pytest.approx(1.1e-3)
    assert a == b


def test_link_rejects_negative_durations():
    with pytest.raises(ValueError, match="negative"):
        LinkQueue().reserve(0.0, -1.0)
