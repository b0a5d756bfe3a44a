"""SBO `combine-down-gemm` in `tandem simulate` (#31): the down projection in one block per local
expert, each block's combine sent as it is done, in the order the kernel's own `compute_experts`
issues them; priced by hand on a `here` profile with given figures; refused where the profile's
transfers are DeepEP's, as the runtime refuses it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from tandem.cli import app
from tandem.modular_kernels.kernel import FusedMoEModularKernel
from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize
from tandem.modular_kernels.prepare_torch_a2a_ll import TorchLowLatencyPrepareAndFinalize
from tandem.simulate import host, simulate
from tandem.simulate.block_combine import block_count
from tandem.simulate.host_link import LinkFit
from tandem.simulate.model_shape import model_shape
from tandem.simulate.ops import Layout, OpCosts, UBatchWork
from tandem.simulate.schedule import moe_forward_order
from tests.support.host_profiles import given_host

DOWN_GEMM, DISPATCH_SHARED = "sbo-combine-down-gemm", "sbo-dispatch-shared"
# The MoE stack at EP2: hidden 1024, expert intermediate 512, 8 experts (4 a rank), top-2, 4 layers.
H, I, LOCAL, LAYERS = 1024, 512, 4, 4
LATENCY, LINK_RATE = 0.5e-3, 1e9  # gloo's fixed cost per call and bytes/s after it (given)
MATMUL, MEMORY = 100e9, 20e9  # the given host: FLOP/s at every GEMM size, bytes/s
SECONDS_PER_BYTE_1000 = 8.0 * 1514 / 1448 / 1000e6  # a 1000 Mbit/s tbf link, whole frames


def _host():
    link = LinkFit({"dispatch": LATENCY, "combine": LATENCY}, {"dispatch": LINK_RATE, "combine": LINK_RATE},
                   {"dispatch": [], "combine": []})
    return given_host(2, small_rate=MATMUL, switch_s=0.0, link=link)


def _prefill(modes, link_mbit=None, tokens=512):
    sim = simulate("moe-stack", _host(), ep=2, phase="prefill", tokens_per_rank=tokens, context=tokens, modes=modes,
                   link_mbit=link_mbit)
    return {r.mode: r for r in sim.results}


# Prefill, 512 tokens a rank, by hand. Each local expert gets 512 x 2 / 4 = 256 rows; a block
# (one per local expert: 4) a quarter of them, 64. Its down GEMM: 2 x 64 x 1024 x 512 x 4 FLOP at
# 100 GFLOP/s = 2.684 ms (its 9.96 MB at 20 GB/s take 0.50 ms: compute-bound, so 4 blocks cost
# what the whole GEMM does). The combine: 512 tokens x 1.5 ranks (top-2 of 2) x 1024 x 4 bytes =
# 3.146 MB, a block a quarter: its CPU part 0.5 ms + 0.786 ms; on the wire half of its bytes.
DOWN_BLOCK_S = 2 * 64 * H * I * LOCAL / MATMUL
COMBINE_BYTES = 512 * 1.5 * H * 4
BLOCK_CPU_S = LATENCY + COMBINE_BYTES / 4 / LINK_RATE
BLOCK_WIRE_S = COMBINE_BYTES / 4 / 2 * SECONDS_PER_BYTE_1000


def _layer_spans(result, layer: int, name: str, lane: str):
    return [s for s in result.spans if s.step.layer == layer and s.step.name == name and s.lane == lane]


def test_each_block_is_priced_and_its_combine_leaves_as_it_is_done():
    result = _prefill([DOWN_GEMM], link_mbit=1000)[DOWN_GEMM]
    (up,) = _layer_spans(result, 1, "experts_up", "compute")
    downs = _layer_spans(result, 1, "experts_down_block", "compute")
    cpu = _layer_spans(result, 1, "combine_block_send", "compute")
    wire = _layer_spans(result, 1, "combine_block_send", "comm")
    assert len(downs) == len(cpu) == len(wire) == LOCAL
    for d, c, w in zip(downs, cpu, wire):
        assert d.end - d.start == pytest.approx(DOWN_BLOCK_S, rel=1e-9)
        assert c.end - c.start == pytest.approx(BLOCK_CPU_S, rel=1e-9)
        assert w.end - w.start == pytest.approx(BLOCK_WIRE_S, rel=1e-9)
        assert w.start == pytest.approx(c.end)  # each block's combine leaves once its CPU part is done
    # Compute-bound (a block's GEMM and CPU part, 3.97 ms, outlast its wire, 3.29 ms): the last
    # block lands one wire time after the last block's CPU part.
    assert BLOCK_WIRE_S < DOWN_BLOCK_S + BLOCK_CPU_S
    assert wire[-1].end - up.end == pytest.approx(LOCAL * (DOWN_BLOCK_S + BLOCK_CPU_S) + BLOCK_WIRE_S, rel=1e-9)
    (output,) = _layer_spans(result, 1, "output", "compute")
    assert output.start == pytest.approx(wire[-1].end)  # the receive waits for the last block


def test_against_the_combine_in_one_piece_by_hand():
    """dispatch-shared sends the whole combine after the whole down GEMM: 4 blocks' GEMMs, then
    0.5 + 3.146 ms of CPU, then 4 wire times. Blocked: the same GEMMs, 4 x (0.5 + 0.786) ms of
    CPU, then one wire time. Per layer it saves 3 wire times and pays 3 more fixed costs."""
    over_link = _prefill([DISPATCH_SHARED, DOWN_GEMM], link_mbit=1000)
    saved = over_link[DISPATCH_SHARED].step_s - over_link[DOWN_GEMM].step_s
    assert saved == pytest.approx(LAYERS * 3 * (BLOCK_WIRE_S - LATENCY), rel=1e-9)
    # gloo on the computing cores, no link: nothing overlaps, each block only adds its fixed cost.
    on_host = _prefill([DISPATCH_SHARED, DOWN_GEMM])
    assert on_host[DOWN_GEMM].step_s - on_host[DISPATCH_SHARED].step_s == pytest.approx(LAYERS * 3 * LATENCY, rel=1e-9)


def test_a_small_block_pays_its_gemm_not_a_share_of_the_whole():
    """Decode-sized: 16 tokens give 8 rows an expert, 2 a block. Each block's GEMM is bound by
    reading the 4 experts' down weights (2 MiB at 20 GB/s), so 4 blocks cost 4 reads, not one."""
    costs = OpCosts(model_shape("moe-stack"), _host(), Layout(ep=2, decode=False, low_latency=False))
    work = UBatchWork(tokens=16, requests=1, attended=136)
    block = LOCAL * 4 * (H * I + 2 * I + 2 * H) / MEMORY
    whole = LOCAL * 4 * (H * I + 8 * I + 8 * H) / MEMORY
    assert costs.down_projection(work, LOCAL) == pytest.approx(block, rel=1e-12)
    assert costs.down_projection(work) == pytest.approx(whole, rel=1e-12)
    assert LOCAL * block > 3.9 * whole


def test_the_block_order_is_the_kernels():
    assert moe_forward_order(True, dbo=False, sbo_mode="combine-down-gemm", blocks=2) == [
        "dispatch_send", "shared_experts", "dispatch_recv", "experts_up",
        "experts_down_block", "combine_block_send", "experts_down_block", "combine_block_send",
        "combine_recv", "output",
    ]  # fmt: skip


def test_changing_the_kernels_block_loop_changes_the_timeline(monkeypatch):
    """A kernel that computed every block before sending any would lose the overlap of the
    blocks' CPU parts with the wire: the last block lands at 4 GEMMs + 1 CPU part + 4 wire
    times (the wire is the longer) instead of 4 x (GEMM + CPU part) + 1 wire time."""
    before = _prefill([DOWN_GEMM], link_mbit=1000)[DOWN_GEMM].step_s

    def every_block_then_send(self, state):
        combine = self.prepare_finalize.finalize_in_blocks(state.tokens, state.topk_weights, state.topk_ids)
        outputs = list(self.experts.apply_blocks(state.tokens, state.w1, state.w2, combine.blocks))
        for index, output in outputs:
            combine.send(index, output)
        state.block_combine = combine

    monkeypatch.setattr(FusedMoEModularKernel, "compute_experts", every_block_then_send)
    order = moe_forward_order(False, dbo=False, sbo_mode="combine-down-gemm", blocks=2)
    assert order[2:7] == ["experts_up", "experts_down_block", "experts_down_block", "combine_block_send", "combine_block_send"]
    after = _prefill([DOWN_GEMM], link_mbit=1000)[DOWN_GEMM].step_s
    assert BLOCK_CPU_S < BLOCK_WIRE_S
    assert after - before == pytest.approx(LAYERS * 3 * (BLOCK_WIRE_S - BLOCK_CPU_S), rel=1e-9)


def test_one_block_per_local_expert_is_what_the_block_combining_backends_cut():
    costs = OpCosts(model_shape("moe-stack"), _host(), Layout(ep=2, decode=False, low_latency=False))
    rows = torch.arange(8)
    standard = TorchAllToAllPrepareAndFinalize.__new__(TorchAllToAllPrepareAndFinalize)
    standard.num_local_experts = LOCAL
    received = SimpleNamespace(hidden=torch.zeros(8, 1), handle=(rows, [4, 4], [4, 4], 8))  # 4 rows from each rank
    masked = TorchLowLatencyPrepareAndFinalize.__new__(TorchLowLatencyPrepareAndFinalize)
    masked.num_local_experts = LOCAL
    slots = SimpleNamespace(handle=(None, None, None, H))
    assert len(standard.finalize_in_blocks(received, None, None).blocks) == block_count(costs) == LOCAL
    assert len(masked.finalize_in_blocks(slots, None, None).blocks) == LOCAL


@pytest.mark.parametrize("phase, tokens, backend", [("prefill", 4096, "deepep_high_throughput"), ("decode", 128, "deepep_low_latency")])
def test_deepeps_backends_refuse_it_with_the_runtimes_reason(phase, tokens, backend):
    with pytest.raises(ValueError, match=f"whose transfers are {backend}'s: sbo_mode 'combine-down-gemm' sends the combine per block"):
        simulate("deepseek-v3", "h800", ep=32, phase=phase, tokens_per_rank=tokens, modes=["none", DOWN_GEMM])


def test_the_cli_plays_it_on_here_and_refuses_it_on_a_gpu(monkeypatch):
    monkeypatch.setattr(host, "host_profile", lambda ranks: _host())
    stack = ["--model", "moe-stack", "--ep", "2", "--tokens-per-rank", "512", "--context", "512"]
    result = CliRunner().invoke(app, ["simulate", "--hardware", "here", *stack, "--modes", f"none,{DOWN_GEMM}",
                                      "--link-mbit", "1000"], terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    assert set(rows) == {"none", DOWN_GEMM}
    refused = CliRunner().invoke(app, ["simulate", "--hardware", "h800", "--modes", DOWN_GEMM], terminal_width=200)
    assert refused.exit_code == 2
    assert "whose transfers are deepep_high_throughput's" in refused.output
