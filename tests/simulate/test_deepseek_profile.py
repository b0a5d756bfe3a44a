"""The terms `tandem simulate` took from DeepSeek's profile (#31): MTP decode, the other kernels'
passes, a low-latency call's SM part, the normal kernels' barrier and overlapped bandwidth, the
hand-over cost; each on a case computed by hand from h800.json's figures."""

from __future__ import annotations

import pytest

from tandem.simulate import load_hardware, model_shape, simulate
from tandem.simulate.ops import Layout, OpCosts, UBatchWork
from tandem.simulate.run import Workload
from tandem.simulate.schedule import Step, play

HW = load_hardware("h800")
V3 = model_shape("deepseek-v3")


def test_a_draft_token_doubles_the_queries_not_the_cache_read():
    """4 requests at context 100 with one draft each: 8 query tokens, each attending to 100 keys,
    the cache of each request read once; 4 x (1 + 0.5) tokens kept."""
    wl = Workload("decode", 4, 100, draft_tokens=1, acceptance=0.5)
    assert wl.split(2) == [UBatchWork(4, 2, 400, 200), UBatchWork(4, 2, 400, 200)]
    assert wl.output_tokens == 6.0 and Workload("prefill", 64, 32).output_tokens == 64
    with pytest.raises(ValueError, match="decode setting"):
        Workload("prefill", 64, 32, draft_tokens=1)
    sim = simulate("deepseek-v3", "h800", ep=128, phase="decode", tokens_per_rank=128, modes=["tbo"],
                   draft_tokens=1, acceptance=0.6)
    assert sim.results[0].tokens_per_s == pytest.approx(128 * 1.6 / sim.results[0].step_s)


def test_flashmla_reads_the_latent_cache_once_per_request():
    """64 requests x 2 queries at 4096: 2 x 128 heads x (576 + 512) x 524,288 FLOPs at 580
    TFLOPS (252 µs, the profile's 501 µs per layer / 2), above 262,144 x 576 x 2 bytes at 3 TB/s."""
    costs = OpCosts(V3, HW, Layout(ep=128, decode=True, low_latency=True))
    work = UBatchWork(128, 64, 524288, 262144)
    flops = 2 * 128 * 1088 * 524288
    assert costs.attention_kernel(work) == pytest.approx(flops / 580e12) == pytest.approx(251.8e-6, abs=0.1e-6)
    memory_bound = UBatchWork(64, 64, 64, 64 * 10**6)  # one query each, long contexts: bytes win
    assert costs.attention_kernel(memory_bound) == pytest.approx(64e6 * 576 * 2 / 3e12)


def test_the_other_kernels_cost_their_measured_passes_per_token():
    """A MoE layer's norm-like ops together: 58.5 hidden-sized BF16 passes per token at the
    achieved HBM rate (3.35 TB/s x 0.80), for 1,000 tokens 1000 x 7168 x 2 x 58.5 / 2.68e12."""
    costs = OpCosts(V3, HW, Layout(ep=32, decode=False, low_latency=False))
    work = UBatchWork(1000, 1, 1000)
    ops = ("comm_prepare_attn", "comm_prepare_mlp", "output", "comm_postprocess_layer")
    assert sum(costs.compute(op, work) for op in ops) == pytest.approx(1000 * 7168 * 2 * 58.5 / 2.68e12)


def test_a_low_latency_call_puts_its_sm_part_on_the_compute_stream():
    """EP128, 128 tokens: 31 µs of the dispatch's published latency on the compute stream, the
    rest in flight; 64 tokens: half of it. The call's total is unchanged."""
    costs = OpCosts(V3, HW, Layout(ep=128, decode=True, low_latency=True))
    for tokens, sm in ((128, 31e-6), (64, 15.5e-6)):
        work = UBatchWork(tokens, tokens, 0)
        total = HW.transfer_time("dispatch", costs.transfer_bytes("dispatch", work), ep=128, low_latency=True)
        assert costs.send_kernel("dispatch", work) == pytest.approx(sm)
        assert costs.transfer("dispatch", work) + sm == pytest.approx(total)


def test_a_normal_call_pays_its_barrier_and_loses_bandwidth_under_overlap():
    """EP32 dispatch of 8,192 tokens: bytes / 58 GB/s, / 0.793 while compute overlaps, and a barrier
    of 0.276 of the wire time at 58 GB/s."""
    layout = Layout(ep=32, decode=False, low_latency=False)
    work = UBatchWork(8192, 2, 0)
    plain, overlapped = OpCosts(V3, HW, layout), OpCosts(V3, HW, layout, sm_share=108 / 132, overlapped=True)
    wire = plain.transfer_bytes("dispatch", work) / 58e9
    assert plain.transfer("dispatch", work) == pytest.approx(wire * 1.276)
    assert overlapped.transfer("dispatch", work) == pytest.approx(wire / 0.793 + wire * 0.276)
    assert plain.send_kernel("dispatch", work) == 0.0


def test_play_runs_a_send_kernel_before_its_transfer():
    """Ubatch 0: kernel 1 then transfer 2; ubatch 1's compute (3) waits for the kernel only;
    ubatch 0's experts wait for the landing at 3 and for the stream (free at 4)."""
    send, recv, experts, attn = Step(0, "dispatch_send"), Step(0, "dispatch_recv"), Step(0, "experts"), Step(0, "attn_core")
    order = [(0, send), (1, attn), (0, recv), (0, experts)]
    cost = {"dispatch_send": 2.0, "attn_core": 3.0, "experts": 5.0}
    spans = play(order, lambda u, s: cost[s.name], sync_comm=False, kernel=lambda u, s: 1.0)
    got = [(s.ubatch, s.lane, s.step.name, s.start, s.end) for s in spans]
    assert got == [(0, "compute", "dispatch_send", 0.0, 1.0), (0, "comm", "dispatch_send", 1.0, 3.0),
                   (1, "compute", "attn_core", 1.0, 4.0), (0, "compute", "experts", 4.0, 9.0)]


def test_a_gemm_of_deepseeks_own_weights_runs_at_deepgemms_published_rate():
    """DeepGEMM's README rows for the 2112 x 7168 weight (q_a + kv_a): 206 TFLOPS at m=64, 352 at
    128, 1058 at 4096. m=128 takes 352 exactly; m=256, a fifth of the log distance to 4096,
    352 + 0.2 x 706; m=32 the time of m=64; two rows at one m (4096 x 7168: normal 1304, eight
    groups 1288) average; a weight the table lacks keeps the curve."""
    assert HW.gemm_time(128, 2112, 7168) == pytest.approx(2 * 128 * 2112 * 7168 / 352e12)
    assert HW.gemm_table_rate(256, 2112, 7168) == pytest.approx((352 + 0.2 * 706) * 1e12)
    assert HW.gemm_time(32, 2112, 7168) == pytest.approx(HW.gemm_time(64, 2112, 7168))
    assert HW.gemm_table_rate(4096, 4096, 7168) == pytest.approx(1296e12)
    assert HW.gemm_time(128, 2112, 7168, sm_share=0.5) == pytest.approx(2 * HW.gemm_time(128, 2112, 7168))
    assert HW.gemm_table_rate(128, 1000, 7168) is None and HW.gemm_table_rate(128, 2112, 7168) == 352e12
