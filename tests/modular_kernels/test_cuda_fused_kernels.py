"""The fused kernels compiled on a real CUDA device (not interpreted) against their torch
paths: residual-add + RMSNorm, SiLU-and-mul, routing top-k, the align step, RoPE + cache
write, each with no host sync and inside a captured CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tandem.models.norm import fused_add_rms_norm, fused_add_rms_norm_triton
from tandem.models.paged_attention import write_to_cache
from tandem.models.rope import RopeConfig, RotaryEmbedding
from tandem.models.rope_kernel import rope_and_cache_triton
from tandem.modular_kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from tandem.modular_kernels.moe_align import align_pairs_by_expert_torch, align_pairs_by_expert_triton
from tandem.modular_kernels.topk_kernel import fused_topk_triton

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    x, res = torch.randn(64, 2048, device="cuda", dtype=dtype), torch.randn(64, 2048, device="cuda", dtype=dtype)
    w = torch.rand(2048, device="cuda", dtype=dtype) + 0.5
    with no_host_sync():
        normed, total = fused_add_rms_norm_triton(x, res, w, 1e-6)
    total_ref = res + x
    torch.testing.assert_close(total, total_ref, **TOL[dtype])
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(total_ref, (2048,), w, 1e-6), **TOL[dtype])
    assert fused_add_rms_norm(x, res, w, 1e-6)[0].data_ptr() != normed.data_ptr()  # a fresh output each call


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(37, 2 * 1408, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul_triton(x).float(), silu_and_mul_torch(x.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_and_align(dtype):
    from tandem.modular_kernels.routing import select_experts

    logits = torch.randn(256, 64, device="cuda", dtype=dtype)
    with no_host_sync():
        weights, ids = fused_topk_triton(logits, 6, renormalize=False)
        sorted_ids, block_expert = align_pairs_by_expert_triton(ids, 64, 16)
    ref_weights, ref_ids = select_experts(logits.cpu(), 6, renormalize=False)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-5, rtol=1e-5)
    want_ids, want_blocks = align_pairs_by_expert_torch(ids.cpu(), 64, 16)
    assert torch.equal(sorted_ids.cpu(), want_ids) and torch.equal(block_expert.cpu().to(torch.int32), want_blocks)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_and_cache_write(interleaved):
    rope = RopeConfig("default", 10000.0, max_positions=4096)
    rotary = RotaryEmbedding(64, rope, interleaved=interleaved).cuda()
    q, k = torch.randn(32, 16, 64, device="cuda"), torch.randn(32, 4, 64, device="cuda")
    v = torch.randn(32, 4, 64, device="cuda")
    positions = torch.randint(0, 4096, (32,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:32]
    keys, values = torch.zeros(4, 16, 4, 64, device="cuda"), torch.zeros(4, 16, 4, 64, device="cuda")
    want_q, want_k = rotary(positions, q, k)
    want_keys, want_values = keys.clone(), values.clone()
    write_to_cache(want_keys, want_k, slots)
    write_to_cache(want_values, v, slots)
    with no_host_sync():
        rope_and_cache_triton(rotary.cos_sin_cache, positions, q, k, interleaved=interleaved, slot_mapping=slots,
                              k_cache=keys, copy=(v, values))  # fmt: skip
    torch.testing.assert_close(q, want_q, **TOL[torch.float32])
    torch.testing.assert_close(keys, want_keys, **TOL[torch.float32])
    assert torch.equal(values, want_values)


def test_kernels_capture_in_a_cuda_graph():
    x, res = torch.randn(8, 512, device="cuda"), torch.randn(8, 512, device="cuda")
    w = torch.ones(512, device="cuda")
    logits = torch.randn(8, 64, device="cuda")
    ids = fused_topk_triton(logits, 6, renormalize=True)[1]
    eager = (fused_add_rms_norm_triton(x, res, w, 1e-6)[0], align_pairs_by_expert_triton(ids, 64, 16)[0])  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed = fused_add_rms_norm_triton(x, res, w, 1e-6)[0]
        rows = align_pairs_by_expert_triton(fused_topk_triton(logits, 6, renormalize=True)[1], 64, 16)[0]
    graph.replay()
    torch.testing.assert_close(normed, eager[0])
    assert torch.equal(rows, eager[1])
