"""The GPU expert kernels on a real CUDA device: Triton compiled (not interpreted) against
the torch reference at bf16 tolerances, DeepGEMM when it is importable, and no host sync
in the sort-and-pad step of the Triton path. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.modular_kernels import (
    ExpertTokens,
    TorchBatchedExperts,
    TorchExperts,
    select_experts,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: bf16 operands and outputs: a relative Frobenius error well under 1 % against the float32 math.
BF16_REL_TOL = 1e-2
#: DeepGEMM computes in fp8 (activations, weights and the requantized intermediate).
FP8_REL_TOL = 8e-2


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _problem(num_experts=8, hidden=256, inter=128, num_tokens=64, top_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize=True)
    ids[::5, 1] = -1  # some pairs routed to another rank
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    return x.to(**cuda), w1.to(**cuda), w2.to(**cuda), weights.cuda(), ids.cuda()


def _masked_tokens(x: torch.Tensor, num_experts: int, max_rows: int) -> ExpertTokens:
    counts = torch.tensor([max_rows, 0, 1, max_rows // 2] * (num_experts // 4), device="cuda")
    rows = x[: num_experts * max_rows].reshape(num_experts, max_rows, -1)
    return ExpertTokens(rows.contiguous(), None, torch.bfloat16, expert_num_tokens=counts)


@pytest.fixture
def compiled_triton(monkeypatch):
    """Other test modules set TRITON_INTERPRET=1 at import; tandem defines its kernels per
    mode when first used, so without it they compile for the GPU."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_triton_standard_compiled_matches_the_torch_reference(compiled_triton):
    from tandem.modular_kernels.experts_triton import TritonExperts

    x, w1, w2, weights, ids = _problem()
    tokens = ExpertTokens(x, None, torch.bfloat16, topk_ids=ids, topk_weights=weights)
    out = TritonExperts().apply(tokens, w1, w2)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert _rel_err(out, TorchExperts().apply(tokens, w1, w2)) < BF16_REL_TOL


def test_triton_masked_compiled_matches_the_torch_reference(compiled_triton):
    from tandem.modular_kernels.experts_triton import TritonBatchedExperts

    x, w1, w2, _, _ = _problem()
    tokens = _masked_tokens(x, w1.shape[0], 8)
    out = TritonBatchedExperts().apply(tokens, w1, w2)
    ref = TorchBatchedExperts().apply(tokens, w1, w2)
    assert _rel_err(out, ref) < BF16_REL_TOL
    assert (out[1] == 0).all()  # an expert with no rows


def test_align_pairs_by_expert_syncs_nothing_and_captures(compiled_triton):
    from tandem.modular_kernels.experts_triton import align_pairs_by_expert

    _, _, _, _, ids = _problem()
    align_pairs_by_expert(ids, 8, 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        align_pairs_by_expert(ids, 8, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_ids = ids.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        align_pairs_by_expert(static_ids, 8, 16)  # warm-up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        outputs = align_pairs_by_expert(static_ids, 8, 16)
    static_ids.copy_(ids.flip(0))
    graph.replay()
    for got, want in zip(outputs, align_pairs_by_expert(ids.flip(0), 8, 16)):
        assert torch.equal(got, want)


@pytest.fixture
def real_deep_gemm():
    deep_gemm = pytest.importorskip("deep_gemm", exc_type=ImportError)
    if getattr(deep_gemm, "IS_FAKE", False):
        pytest.skip("the CPU emulation is installed, not DeepGEMM")
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        pytest.skip(f"DeepGEMM's fp8 GEMMs need SM90 or SM100, this is sm_{major}x")
    return deep_gemm


def test_deep_gemm_masked_matches_the_torch_reference(real_deep_gemm):
    from tandem.modular_kernels.experts_deep_gemm import DeepGemmBatchedExperts

    x, w1, w2, _, _ = _problem()
    tokens = _masked_tokens(x, w1.shape[0], 8)  # M=8 with 8 experts: padded to 128 rows
    out = DeepGemmBatchedExperts().apply(tokens, w1, w2)
    assert _rel_err(out, TorchBatchedExperts().apply(tokens, w1, w2)) < FP8_REL_TOL
    assert (out[1] == 0).all()


def test_deep_gemm_standard_matches_the_torch_reference(real_deep_gemm):
    from tandem.modular_kernels.experts_deep_gemm import DeepGemmExperts

    x, w1, w2, weights, ids = _problem()
    tokens = ExpertTokens(x, None, torch.bfloat16, topk_ids=ids, topk_weights=weights)
    out = DeepGemmExperts().apply(tokens, w1, w2)
    assert _rel_err(out, TorchExperts().apply(tokens, w1, w2)) < FP8_REL_TOL
