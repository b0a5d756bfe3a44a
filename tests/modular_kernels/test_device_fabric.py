"""The on-device fabric leaves results exact and issues its transfers on the comm stream:
sender's event → comm waits → spin → arrival event → receiver's stream waits (checked here on
the CPU platform's protocol trace; tests/cuda times it on a GPU)."""

from __future__ import annotations

import torch

from tandem.contexts import run_ubatches
from tandem.modular_kernels import FabricModel, build_moe_kernel, torch_moe_reference
from tandem.modular_kernels.device_fabric import DeviceFabricPrepareAndFinalize, install_device_fabric
from tandem.platform import CpuPlatform


def _case(tokens=6, hidden=16, experts=4, top_k=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(experts, 8, hidden, generator=g) / 4
    w2 = torch.randn(experts, hidden, 4, generator=g) / 2
    weights = torch.rand(tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x, w1, w2, weights, ids


def test_results_are_exact_and_transfers_follow_the_stream_protocol():
    x, w1, w2, weights, ids = _case()
    kernel = build_moe_kernel("local", "torch", num_experts=4, top_k=2, hidden_size=16)
    trace: list = []
    platform = CpuPlatform(trace=trace)
    kernel.prepare_finalize = DeviceFabricPrepareAndFinalize(kernel.prepare_finalize, FabricModel(1e-6, 1e12), platform)
    out = kernel(x, w1, w2, weights, ids)
    torch.testing.assert_close(out, torch_moe_reference(x, w1, w2, weights, ids))
    ops = [entry[0] for entry in trace]
    # Two transfers (dispatch, combine), each: record on the sender, comm waits, record on comm, receiver waits.
    assert ops == ["record", "wait", "record", "wait"] * 2, trace
    comm = trace[1][2]
    assert comm != "default" and trace[2][2] == comm and trace[3][2] == "default"


def test_under_dbo_the_ubatch_comm_stream_carries_the_transfer_and_install_is_reversible():
    x, w1, w2, weights, ids = _case(tokens=8)
    model = torch.nn.Module()
    model.kernel = build_moe_kernel("local", "torch", num_experts=4, top_k=2, hidden_size=16)
    assert install_device_fabric(model, FabricModel(1e-6, 1e12)) == 1
    assert isinstance(model.kernel.prepare_finalize, DeviceFabricPrepareAndFinalize)
    halves = [lambda h=h, w=w, i=i: model.kernel(h, w1, w2, w, i) for h, w, i in zip(x.chunk(2), weights.chunk(2), ids.chunk(2))]
    out = torch.cat(run_ubatches(halves))
    torch.testing.assert_close(out, torch_moe_reference(x, w1, w2, weights, ids))
    install_device_fabric(model, FabricModel(1e-6, 1e12))  # re-installing wraps once, not twice
    assert not isinstance(model.kernel.prepare_finalize.inner, DeviceFabricPrepareAndFinalize)
    install_device_fabric(model, None)
    assert model.kernel.prepare_finalize.name == "local"
