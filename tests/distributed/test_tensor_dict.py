"""Tensor dicts between two real gloo ranks over a `StageLink`: one message per transfer
(metadata and CPU tensors in one frame), empty tensors kept with their shape and dtype, a
frame over the link's capacity still arrives whole, a receive posted in advance gets the next
message, several sends in flight (async depth 1 and 2) arrive intact because each
`PendingSend` owns its buffers until it is waited, and a missing peer is a bounded error."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from tandem.distributed import StageLink, StageLinkError, Topology, init_stage_groups
from tandem.testing.distributed import run_distributed

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow


def _payload(i: int) -> dict:
    return {
        "meta": {"step": i, "ids": ["a", "b"][: i % 3]},
        "hidden": torch.full((3, 4), float(i)),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "tokens": torch.arange(i, i + 5, dtype=torch.int64),
    }


def _link(groups, capacity_bytes=None):
    extra = {} if capacity_bytes is None else {"capacity_bytes": capacity_bytes}
    return StageLink(1 - groups.rank, cpu_group=groups.cpu_group, device_group=groups.device_group, **extra)


def _exchange(rank, world, depth, capacity_bytes=None):
    groups = init_stage_groups(Topology(2, 1), timeout_s=60)
    link = _link(groups, capacity_bytes)
    count = 6
    if rank == 0:
        pending = []
        for i in range(count):
            # Build each payload in a scope that drops it: only the PendingSend keeps its buffers.
            pending.append(link.send(_payload(i)))
            gc.collect()
            while len(pending) > depth + 1:
                pending.pop(0).wait()
        for send in pending:
            send.wait()
        # A send whose handle is dropped at once still arrives whole (dropping it finishes it).
        link.send(_payload(count))
        ack = link.recv(timeout_s=60)
        return ack["ok"]
    received = []
    link.expect()  # posted before the first send: it gets the first message
    for i in range(count + 1):
        time.sleep(0.05)  # a slow receiver: the sender runs ahead by `depth`
        received.append(link.recv(timeout_s=60))
        if i < count:
            link.expect()
    ok = all(
        r["meta"] == _payload(i)["meta"]
        and torch.equal(r["hidden"], _payload(i)["hidden"])
        and torch.equal(r["tokens"], _payload(i)["tokens"])
        and r["empty"].shape == (0, 4) and r["empty"].dtype == torch.bfloat16
        for i, r in enumerate(received)
    )
    link.send({"ok": ok}).wait()
    return ok


@pytest.mark.parametrize("depth", [1, 2])
def test_sends_in_flight_arrive_intact(depth):
    assert run_distributed(_exchange, 2, depth, timeout_s=60) == [True, True]


def test_frames_over_the_link_capacity_arrive_whole():
    # 64 bytes holds the header but none of the payloads: every frame takes the two-message path.
    assert run_distributed(_exchange, 2, 1, 64, timeout_s=60) == [True, True]


def _silent_peer(rank, world):
    groups = init_stage_groups(Topology(2, 1), timeout_s=60)
    if rank == 0:
        try:
            _link(groups).recv(timeout_s=0.5)
        except StageLinkError as exc:
            return str(exc)
        return "no error"
    time.sleep(1.5)
    return ""


def test_a_silent_peer_is_a_bounded_error():
    message = run_distributed(_silent_peer, 2, timeout_s=60)[0]
    assert "receiving from rank 1" in message and "dead or hung" in message
