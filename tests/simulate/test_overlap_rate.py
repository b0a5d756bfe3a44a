"""An overlapped op pays for the overlap only while it overlaps (#31): compute runs at the SMs a
normal DeepEP transfer leaves it only while a transfer is in flight, a transfer at the bandwidth
it keeps under overlap only while compute runs; each at full rate otherwise. Hand-computed
`play` cases, then the modes this changes (SBO prefill) and those it must not (none, decode)."""

from __future__ import annotations

import pytest

from tandem.simulate import simulate
from tandem.simulate.schedule import Step, issue_order, play

ATTN, EXPERTS = Step(0, "attn_core"), Step(0, "experts")
SEND, RECV = Step(0, "dispatch_send"), Step(0, "dispatch_recv")


def _spans(order, cost, rate):
    spans = play(order, lambda u, s: cost[s.name], sync_comm=False, overlap_rate=lambda u, s: rate[s.name])
    return [(s.ubatch, s.lane, s.step.name, s.start, s.end) for s in spans]


def test_compute_runs_at_the_share_only_for_the_part_a_transfer_overlaps():
    """Ubatch 0's transfer (2 s) from 0; ubatch 1's attention (3 s alone, at 0.5 under a transfer)
    from 0: 2 s overlapped do 1 s of its work, the other 2 s run alone: it ends at 4, not 6."""
    got = _spans([(0, SEND), (1, ATTN)], {"dispatch_send": 2.0, "attn_core": 3.0},
                 {"dispatch_send": 1.0, "attn_core": 0.5})
    assert got == [(0, "comm", "dispatch_send", 0.0, 2.0), (1, "compute", "attn_core", 0.0, 4.0)]


def test_a_transfer_issued_after_a_compute_op_slows_it_from_where_it_starts():
    """DBO's order: ubatch 0's attention (1 s), ubatch 1's attention (4 s), then ubatch 0's
    dispatch (2 s), which starts at 1, inside ubatch 1's attention: [1, 3] at 0.5 does 1 s of
    it, the remaining 3 s alone: it ends at 6 (5 against the transfers issued before it only)."""
    order = [(0, ATTN), (1, ATTN), (0, SEND)]
    cost = {"attn_core": 1.0, "dispatch_send": 2.0}
    got = play(order, lambda u, s: cost[s.name] * (4.0 if (u, s) == (1, ATTN) else 1.0), sync_comm=False,
               overlap_rate=lambda u, s: 0.5 if s is ATTN else 1.0)
    assert [(s.ubatch, s.lane, s.start, s.end) for s in got] == [
        (0, "compute", 0.0, 1.0), (1, "compute", 1.0, 6.0), (0, "comm", 1.0, 3.0)]


def test_a_transfer_keeps_its_overlap_bandwidth_only_while_compute_runs():
    """Both at 0.5 under overlap from 0: by 4 the transfer has done its 2 s and the attention 2 of
    its 3 s; the last 1 s of attention runs alone. Then ubatch 0's experts wait for the landing."""
    order = [(0, SEND), (1, ATTN), (0, RECV), (0, EXPERTS)]
    got = _spans(order, {"dispatch_send": 2.0, "attn_core": 3.0, "experts": 1.0},
                 {"dispatch_send": 0.5, "attn_core": 0.5, "experts": 0.5})
    assert got == [(0, "comm", "dispatch_send", 0.0, 4.0), (1, "compute", "attn_core", 0.0, 5.0),
                   (0, "compute", "experts", 5.0, 6.0)]


def test_without_overlap_the_rates_change_nothing():
    """One ubatch with every send blocking compute (none): the sum, whatever the rates."""
    layer = [ATTN, SEND, RECV, EXPERTS]
    cost = {"attn_core": 3.0, "dispatch_send": 2.0, "experts": 5.0}
    spans = play(issue_order([layer], [0]), lambda u, s: cost[s.name], sync_comm=True, overlap_rate=lambda u, s: 0.5)
    assert max(s.end for s in spans) == 10.0


def test_sbo_prefill_no_longer_pays_the_overlap_where_nothing_overlaps():
    """DeepSeek-V3 on H800, EP32 prefill, normal kernels: SBO overlaps only the shared experts, so
    only they (and the transfer beside them) pay for the overlap; it beats none (it was 14 %
    below: every op at 108 of 132 SMs, every transfer at its overlap bandwidth). `none` is as
    before (5,190 tok/s/GPU at 16K tokens: nothing overlaps in it; 5,176 with the normal kernels'
    barrier taken against the blog's unit-test bars)."""
    for tokens in (512, 16384):
        none, combine, dispatch = simulate("deepseek-v3", "h800", ep=32, phase="prefill", tokens_per_rank=tokens,
                                           modes=["none", "sbo-combine-shared", "sbo-dispatch-shared"]).results
        assert none.step_s == pytest.approx(none.compute_s + none.comm_s)
        for sbo in (combine, dispatch):
            assert sbo.step_s < none.step_s
            assert sbo.step_s > none.step_s - _shared_experts(none)  # it can hide at most the shared experts
    assert none.tokens_per_s == pytest.approx(5190, abs=1)


def _shared_experts(result) -> float:
    return sum(s.end - s.start for s in result.spans if s.step.name == "shared_experts")


def test_a_model_without_shared_experts_gets_nothing_from_sbo():
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 1024,
              "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
              "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000}
    none, sbo = simulate(config, "h800", ep=16, phase="prefill", tokens_per_rank=1024, context=256,
                         modes=["none", "sbo-combine-shared"]).results
    assert sbo.step_s == pytest.approx(none.step_s, rel=1e-12)
