"""DeepEP's normal dispatch holds the host (#31): it launches its notify kernel and busy-waits on
the CPU for the received counts before it can allocate the receive buffers and launch the
dispatch (DeepEP docs/legacy.md). `play` holds every op issued after such a send until the
transfer has run that long; `OpCosts.host_wait` prices it as the call's notify (its barrier);
the DBO order puts the send where the runtime's backend issues it (after its yield)."""

from __future__ import annotations

import pytest

from tandem.modular_kernels.kernel import FusedMoEModularKernel
from tandem.modular_kernels.prepare_deepep import DeepEPHighThroughputPrepareAndFinalize, DeepEPLowLatencyPrepareAndFinalize
from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize
from tandem.simulate import load_hardware, model_shape
from tandem.simulate.ops import Layout, OpCosts, UBatchWork
from tandem.simulate.schedule import Step, issue_order, layer_steps, moe_forward_order, play
from tests.support.host_profiles import given_host

HW, V3 = load_hardware("h800"), model_shape("deepseek-v3")
SEND, RECV, EXPERTS, ATTN = Step(0, "dispatch_send"), Step(0, "dispatch_recv"), Step(0, "experts"), Step(0, "attn_core")
COST = {"dispatch_send": 10.0, "combine_send": 4.0, "attn_core": 3.0, "experts": 5.0}


def _spans(order, wait):
    spans = play(order, lambda u, s: COST[s.name], sync_comm=False, host_wait=lambda u, s: wait)
    return [(s.ubatch, s.lane, s.step.name, s.start, s.end) for s in spans]


def test_ops_issued_after_the_send_wait_for_its_notify():
    """Ubatch 0 sends (10 on the comm stream, the host held for its first 2), ubatch 1's attention
    was issued after it: it starts at 2, not 0; ubatch 0's experts wait for the landing (10)."""
    order = [(0, SEND), (1, ATTN), (0, RECV), (0, EXPERTS)]
    assert _spans(order, 0.0)[1] == (1, "compute", "attn_core", 0.0, 3.0)
    assert _spans(order, 2.0) == [(0, "comm", "dispatch_send", 0.0, 10.0), (1, "compute", "attn_core", 2.0, 5.0),
                                  (0, "compute", "experts", 10.0, 15.0)]


def test_the_notify_queues_behind_the_comm_stream():
    """Ubatch 1's experts (0-5) and combine (5-9, after its compute) were issued before ubatch 0's
    dispatch, which starts when the comm stream frees (9): the host is held until 9 + 2, so
    ubatch 0's attention, issued after it, starts at 11 though the compute stream is free at 5."""
    combine = Step(0, "combine_send")
    order = [(1, EXPERTS), (1, combine), (0, SEND), (0, ATTN)]
    got = play(order, lambda u, s: COST[s.name], sync_comm=False,
               host_wait=lambda u, s: 2.0 if s.name == "dispatch_send" else None)
    assert [(s.ubatch, s.step.name, s.start, s.end) for s in got] == [
        (1, "experts", 0.0, 5.0), (1, "combine_send", 5.0, 9.0), (0, "dispatch_send", 9.0, 19.0), (0, "attn_core", 11.0, 14.0)]


def test_the_wait_is_the_normal_dispatchs_notify_across_nodes():
    """EP32, 8,192 tokens: the dispatch's barrier, 0.276 of its bytes at DeepEP's 58 GB/s; the
    combine reuses the dispatch's layout (not held); low-latency and intranode: not held."""
    work = UBatchWork(8192, 2, 0)
    normal = OpCosts(V3, HW, Layout(ep=32, decode=False, low_latency=False), sm_share=108 / 132, overlapped=True)
    assert normal.backend() is DeepEPHighThroughputPrepareAndFinalize
    expected = normal.transfer_bytes("dispatch", work) / 58e9 * 0.276
    assert normal.host_wait("dispatch", work) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(1.037e-3, rel=1e-3)  # the chart's 2.08 ms a layer over two calls
    assert normal.host_wait("combine", work) is None
    low_latency = OpCosts(V3, HW, Layout(ep=128, decode=True, low_latency=True))
    assert low_latency.backend() is DeepEPLowLatencyPrepareAndFinalize and low_latency.host_wait("dispatch", work) is None
    assert OpCosts(V3, HW, Layout(ep=8, decode=False, low_latency=False)).host_wait("dispatch", work) is None


def test_gloos_dispatch_holds_the_host_until_its_transfer_starts():
    """`torch_a2a` exchanges the split sizes with a synchronous all-to-all that queues behind the
    bytes already on the link: the host is held until the dispatch's transfer starts (0 after
    it); its combine reuses the sizes and returns at once."""
    gloo = OpCosts(model_shape("moe-stack"), given_host(small_rate=100e9, switch_s=0.0), Layout(ep=2, decode=True, low_latency=False))
    assert gloo.backend() is TorchAllToAllPrepareAndFinalize
    work = UBatchWork(64, 64, 64)
    assert (gloo.host_wait("dispatch", work), gloo.host_wait("combine", work)) == (0.0, None)


def test_a_dispatch_held_behind_the_link_stalls_what_its_ubatch_issues_next():
    """Ubatch 0's dispatch is on the link (0-10); ubatch 1's dispatch is issued at once but its
    transfer starts only when the link frees (10): held until then, the attention ubatch 1 issued
    after it starts at 10, not 0. Not held (None), it runs at once."""
    send_1 = Step(0, "dispatch_send")
    order = [(0, SEND), (1, send_1), (1, ATTN)]
    held = play(order, lambda u, s: COST[s.name], sync_comm=False, host_wait=lambda u, s: 0.0)
    free = play(order, lambda u, s: COST[s.name], sync_comm=False, host_wait=lambda u, s: None)
    assert [(s.ubatch, s.step.name, s.start) for s in held] == [(0, "dispatch_send", 0.0), (1, "dispatch_send", 10.0),
                                                                (1, "attn_core", 10.0)]
    assert [s.start for s in free] == [0.0, 10.0, 0.0]


def test_dbo_issues_a_normal_send_after_the_backends_yield():
    """DeepEP's normal kernels yield inside their send (the runtime's `yields_in_send`): the
    transfer is issued when the ubatch resumes, so the host waits while the other ubatch's
    stage is queued; `_hand_over` then yields no more. The low-latency kernels hand over after."""
    runtime = moe_forward_order(True, dbo=True, yields_in_send=DeepEPHighThroughputPrepareAndFinalize.yields_in_send)
    assert runtime == ["yield", "dispatch_send", "dispatch_recv", "experts", "yield", "combine_send", "shared_experts",
                       "combine_recv", "output"]
    hook = moe_forward_order(True, dbo=True, yields_in_send=DeepEPLowLatencyPrepareAndFinalize.yields_in_send)
    assert hook == ["dispatch_send", "yield", "dispatch_recv", "experts", "combine_send", "shared_experts", "yield",
                    "combine_recv", "output"]
    # Outside DBO nothing yields.
    assert "yield" not in moe_forward_order(True, dbo=False, yields_in_send=True)


def test_the_hand_overs_are_the_kernels_own(monkeypatch):
    """A kernel whose `_hand_over` never yielded would give an order without stage cuts."""
    monkeypatch.setattr(FusedMoEModularKernel, "_hand_over", lambda self, state, field: None)
    assert "yield" not in moe_forward_order(True, dbo=True, yields_in_send=False)


def test_the_runtimes_dbo_order_hides_the_wait_a_send_before_the_yield_pays_it():
    """The MoE stack (4 MoE layers) under DBO, every compute op 1, every transfer 2, a dispatch's
    notify 0.5. Sent before the yield (a backend that hands over after its send) the host is held
    with nothing of the other ubatch queued: the step grows by the 8 dispatches' 0.5 (80 -> 84).
    Sent after it, as DeepEP's normal kernels do (their compute then joining each transfer, the
    runtime's `dbo_switch_to_compute_sync`: `sync_comm`), the wait falls while the other ubatch's
    stage runs: 88 with or without it."""
    steps = {y: layer_steps(model_shape("moe-stack"), dbo=True, yields_in_send=y) for y in (False, True)}
    orders = {y: issue_order([s, s], [0, 0]) for y, s in steps.items()}
    cost = lambda u, s: 2.0 if s.name in ("dispatch_send", "combine_send") else 1.0  # noqa: E731
    wait = lambda u, s: 0.5 if s.name == "dispatch_send" else None  # noqa: E731

    def step(order, sync, host_wait=None):
        return max(s.end for s in play(order, cost, sync_comm=sync, host_wait=host_wait))

    assert (step(orders[False], False), step(orders[False], False, wait)) == (80.0, 84.0)
    assert step(orders[True], True) == step(orders[True], True, wait) == 88.0
