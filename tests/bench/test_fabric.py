"""The modelled interconnect: presets reproduce DeepEP's published figures, a receive is
held back to issue + latency + bytes / bandwidth by sleeping (no CPU burnt), and the time
model counts exposed and hidden communication."""

import time

import pytest
import torch

from tandem.contexts import CommCounters, run_ubatches, time_model
from tandem.contexts.time_model import timed_receive
from tandem.modular_kernels import FabricModel
from tandem.modular_kernels.fabric import (
    DEEPEP_LL_COMBINE_BYTES,
    DEEPEP_LL_DISPATCH_BYTES,
    DEEPEP_LL_H800_US,
    FABRIC_PRESETS,
)
from tandem.testing import run_distributed


@pytest.mark.parametrize("ep", sorted(DEEPEP_LL_H800_US))
def test_deepep_presets_reproduce_published_latencies(ep):
    fabric = FabricModel.from_preset(f"deepep-ll-h800-ep{ep}")
    dispatch_us, combine_us = DEEPEP_LL_H800_US[ep]
    assert fabric.transfer_time(DEEPEP_LL_DISPATCH_BYTES) * 1e6 == pytest.approx(dispatch_us, rel=1e-9)
    assert fabric.transfer_time(DEEPEP_LL_COMBINE_BYTES) * 1e6 == pytest.approx(combine_us, rel=1e-9)
    assert fabric.latency_s >= 0


def test_preset_scales_with_payload_and_named_default_is_ep8():
    assert FABRIC_PRESETS["deepep-ll-h800"] == FABRIC_PRESETS["deepep-ll-h800-ep8"]
    fabric = FabricModel.from_preset("deepep-ll-h800")
    # EP8 published: 77 µs dispatch at 128 tokens; half the payload is cheaper, never below latency.
    assert fabric.latency_s < fabric.transfer_time(DEEPEP_LL_DISPATCH_BYTES // 2) < fabric.transfer_time(DEEPEP_LL_DISPATCH_BYTES)


def test_flags_validation():
    assert FabricModel.from_flags(None, None) is None
    assert FabricModel.from_flags(None, None, "deepep-ll-h800-ep64") == FabricModel.from_preset("deepep-ll-h800-ep64")
    with pytest.raises(ValueError, match="unknown --fabric preset"):
        FabricModel.from_flags(None, None, "infiniband-9000")
    with pytest.raises(ValueError, match="do not combine"):
        FabricModel.from_flags(10, None, "deepep-ll-h800")
    with pytest.raises(ValueError, match="latency"):
        FabricModel.from_flags(-1, None)


def test_engine_config_takes_the_preset():
    from tandem.config import ParallelConfig

    assert ParallelConfig(data_parallel_size=2, fabric="deepep-ll-h800").fabric == "deepep-ll-h800"
    with pytest.raises(ValueError, match="unknown --fabric preset"):
        ParallelConfig(data_parallel_size=2, fabric="nope")


def test_wait_until_sleeps_instead_of_spinning():
    deadline = time.perf_counter() + 0.2
    wall, cpu = time.perf_counter(), time.thread_time()
    FabricModel.wait_until(deadline)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.2 - 1e-3
    assert cpu < 0.02, f"waiting 200 ms burnt {cpu * 1e3:.1f} ms of CPU"


def test_time_model_counts_exposed_and_hidden_transfers():
    # Lower bounds only: a loaded machine may stretch any wait, never shorten it.
    exposed_counters, hidden_counters = CommCounters(), CommCounters()
    with time_model(exposed_counters):
        deadline = time.perf_counter() + 0.05
        exposed = timed_receive(lambda: FabricModel.wait_until(deadline), 0.05)
        exposed()  # received at once: all 50 ms exposed
    with time_model(hidden_counters):
        deadline = time.perf_counter() + 0.05
        hidden = timed_receive(lambda: FabricModel.wait_until(deadline), 0.05)
        time.sleep(0.06)  # other work covers the whole transfer
        hidden()
    assert exposed_counters.transfers == hidden_counters.transfers == 1
    assert exposed_counters.recv_wait_s >= 0.045 and exposed_counters.comm_s >= 0.045
    assert hidden_counters.comm_s >= 0.045
    assert hidden_counters.recv_wait_s < 0.01  # the deadline had passed: nothing left to wait for


def test_switch_time_is_counted_by_the_executor():
    from tandem.contexts import dbo_yield, make_executor

    for kind in ("thread", "greenlet"):
        executor = make_executor(kind)

        def ubatch():
            for _ in range(20):
                dbo_yield()

        run_ubatches([ubatch, ubatch], executor=executor)
        assert executor.switches >= 40
        assert 0 < executor.switch_time_s < 1.0, kind


LATENCY_S = 0.25
GBPS = 0.01  # 10 MB/s: a 1 MB send adds 100 ms


def _fabric_rank(rank, world):
    from tandem.modular_kernels import build_moe_kernel

    torch.set_num_threads(1)
    fabric = FabricModel(LATENCY_S, GBPS * 1e9)
    kernel = build_moe_kernel("torch_a2a", "torch", num_experts=4, top_k=1, hidden_size=256, fabric=fabric)
    pf = kernel.prepare_finalize
    hidden = torch.randn(1024, 256)  # 1 MiB of float32 rows, all to the other rank's expert
    ids = torch.full((1024, 1), 2 * (1 - rank), dtype=torch.int64)
    weights = torch.ones(1024, 1)
    results = {}
    counters = CommCounters()
    with time_model(counters):
        torch.distributed.barrier()
        _, receive = pf.prepare_async(hidden, weights, ids, use_fp8=False)
        issued = time.perf_counter()
        cpu = time.process_time()
        receive()
        results["wall_s"] = time.perf_counter() - issued
        results["cpu_s"] = time.process_time() - cpu
    sent = hidden.numel() * 4 + ids.numel() * 8 + weights.numel() * 4
    results["modelled_s"] = fabric.transfer_time(sent)
    results["recv_wait_s"] = counters.recv_wait_s
    results["comm_s"] = counters.comm_s
    return results


@pytest.mark.slow
def test_modelled_receive_is_held_back_without_burning_cpu():
    for r in run_distributed(_fabric_rank, 2, timeout_s=120):
        modelled = r["modelled_s"]
        assert modelled == pytest.approx(LATENCY_S + (1024 * 256 * 4 + 1024 * 8 + 1024 * 4) / (GBPS * 1e9))
        # Issued just before the receive: the whole modelled time is waited, plus scheduling noise.
        assert modelled - 0.01 <= r["wall_s"] <= modelled + 0.15, r
        # The whole process (gloo's threads included) sleeps through most of the wait.
        assert r["cpu_s"] < 0.25 * r["wall_s"], r
        assert r["recv_wait_s"] >= modelled - 0.01
        # Counts exchange (blocking) + the transfer itself.
        assert r["comm_s"] >= r["recv_wait_s"] - 1e-6
