"""gpu-review-3 G8: the grouped-GEMM experts' pair sum adds the shared experts' output in
the same Triton kernel, under the interpreter, with the roundings of the separate add it
replaces (the sum over k in float32 rounded to the model's dtype, then `routed + shared`
in float32 rounded again): the fused output equals the unfused one bit for bit. The modular
kernel hands the shared output over only where it is ready before the experts run and the
combine is the identity (`local`); every other order keeps the separate add. The
interpreter's float32 -> bfloat16 cast rounds as a GPU's does here
(`tests/support/triton_rounding.py`: it truncates otherwise)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tandem.modular_kernels import build_moe_kernel, select_experts  # noqa: E402
from tandem.modular_kernels.pair_sum import sum_pairs  # noqa: E402
from tests.support.triton_rounding import interpreter_rounds_to_nearest_even  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _gpu_rounding(monkeypatch):
    interpreter_rounds_to_nearest_even(monkeypatch)


def _pairs(tokens=6, top_k=3, hidden=1100, experts=4, seed=1):
    """Weighted pair rows with NaN in the rows no block held (never read): token 0 misses one
    pair, token 4 holds none (its routed sum is 0), token 2 names an expert past the local ones."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids[0, 1], ids[2, 0], ids[4] = -1, experts, -1
    y = torch.randn(tokens * top_k, hidden, generator=g)
    held = ((ids >= 0) & (ids < experts)).reshape(-1)
    y[~held] = float("nan")
    return y, ids, experts


def _shared(layout, tokens, hidden, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(tokens, hidden, generator=g).to(dtype)
    if layout == "row-strided":  # a slice of wider rows
        return torch.randn(tokens, hidden + 37, generator=g).to(dtype)[:, 5 : 5 + hidden]
    return torch.randn(hidden, tokens, generator=g).to(dtype).t()  # "transposed": column stride > 1


@pytest.mark.parametrize("layout", ["contiguous", "row-strided", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_pair_sum_adds_the_shared_output_with_the_separate_adds_bits(dtype, layout):
    y, ids, experts = _pairs()
    shared = _shared(layout, ids.shape[0], y.shape[1], dtype)
    assert shared.is_contiguous() == (layout == "contiguous")
    fused = sum_pairs(y, ids, experts, dtype, shared)
    unfused = sum_pairs(y, ids, experts, dtype) + shared  # what `FusedMoEModularKernel.output` adds
    assert fused.dtype == dtype and not fused.isnan().any()
    assert torch.equal(fused, unfused)
    assert torch.equal(fused[4], shared[4])  # no pair held: the shared row alone
    if dtype == torch.bfloat16:
        # The test pins the order of the roundings: one rounding of the float32 sum differs.
        held = torch.where(torch.isnan(y), 0.0, y).view(*ids.shape, -1).sum(1)
        assert not torch.equal(fused, (held + shared.float()).to(dtype))


def test_the_pair_sum_refuses_a_shared_output_it_cannot_add():
    y, ids, experts = _pairs()
    with pytest.raises(ValueError, match="shared output"):
        sum_pairs(y, ids, experts, torch.bfloat16, torch.zeros(ids.shape[0], y.shape[1]))
    with pytest.raises(ValueError, match="shared output"):
        sum_pairs(y, ids, experts, torch.float32, torch.zeros(ids.shape[0] + 1, y.shape[1]))


def _layer(dtype, moe_backend="triton", tokens=5, hidden=64, inter=32, experts=4, top_k=2):
    """A local MoE kernel with shared experts that log when they run, and its inputs."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    shared_w = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    ids[1, 0] = -1  # a pair with no block
    log = []

    def shared_experts(h):
        log.append("shared")
        return h @ shared_w

    kernel = build_moe_kernel(
        "local", moe_backend, num_experts=experts, top_k=top_k, hidden_size=hidden, shared_experts=shared_experts
    )
    apply = kernel.experts.apply
    kernel.experts.apply = lambda *a, **k: log.append("experts" + "+shared" * ("shared" in k)) or apply(*a, **k)
    return kernel, (x, w1, w2, weights, ids), log


def _steps(kernel, inputs, shared_first):
    """The kernel's steps in TBO's orders: decode runs the shared experts in the dispatch
    window, prefill in the combine window (after the experts)."""
    state = kernel.dispatch_prepare(*inputs)
    kernel.dispatch_send(state)
    if shared_first:
        kernel.compute_shared(state)
    kernel.dispatch_recv(state)
    kernel.compute_experts(state)
    kernel.combine_send(state)
    kernel.compute_shared(state)
    kernel.combine_recv(state)
    return kernel.output(state), state.shared_folded


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_local_triton_kernel_folds_the_shared_output_where_it_is_ready(dtype):
    kernel, inputs, log = _layer(dtype)
    unfused = _steps(kernel, inputs, shared_first=False)
    assert unfused[1] is False and log == ["experts", "shared"]  # after the experts: the separate add
    log.clear()
    folded = kernel(*inputs)  # nothing overlaps the shared experts: they run first
    assert log == ["shared", "experts+shared"]
    assert torch.equal(folded, unfused[0])
    decode = _steps(kernel, inputs, shared_first=True)
    assert decode[1] is True and torch.equal(decode[0], unfused[0])


@pytest.mark.parametrize("shared_first", [None, True, False])
def test_the_fold_is_decided_once_per_experts_step(shared_first, monkeypatch):
    """`compute_experts` asks whether the experts may add the shared output once (it was
    asked twice on one path: to run the shared experts first, then to hand their output
    over), whichever order the shared experts run in."""
    kernel, inputs, _ = _layer(torch.float32)
    asked = []
    adds = kernel.experts.adds_shared_output
    monkeypatch.setattr(kernel.experts, "adds_shared_output", lambda device: asked.append(device) or adds(device))
    if shared_first is None:
        kernel(*inputs)
    else:
        _steps(kernel, inputs, shared_first)
    assert len(asked) == 1 or (shared_first is False and len(asked) <= 1)  # nothing ready: may skip


def test_the_torch_experts_keep_the_order_and_the_add():
    """The CPU path: shared experts after the routed ones, their outputs added apart."""
    kernel, inputs, log = _layer(torch.bfloat16, moe_backend="torch")
    assert not kernel.experts.adds_shared_output(torch.device("cpu"))
    kernel(*inputs)
    assert log == ["experts", "shared"]
    log.clear()
    assert _steps(kernel, inputs, shared_first=True)[1] is False and log == ["shared", "experts"]


def test_only_an_identity_combine_lets_the_experts_add_the_shared_output():
    from tandem.modular_kernels.device_fabric import DeviceFabricPrepareAndFinalize
    from tandem.modular_kernels.fabric import FabricModel
    from tandem.modular_kernels.prepare_deepep import _DeepEPPrepareAndFinalize
    from tandem.modular_kernels.prepare_local import LocalPrepareAndFinalize
    from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize
    from tandem.modular_kernels.prepare_torch_a2a_ll import TorchLowLatencyPrepareAndFinalize

    local = LocalPrepareAndFinalize(4)
    assert local.combine_is_identity
    assert DeviceFabricPrepareAndFinalize(local, FabricModel(1e-6, 1e9)).combine_is_identity
    for backend in (TorchAllToAllPrepareAndFinalize, TorchLowLatencyPrepareAndFinalize, _DeepEPPrepareAndFinalize):
        assert not backend.combine_is_identity, backend
