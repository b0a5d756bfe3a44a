"""The `triton` expert backend, run on CPU under the Triton interpreter, against the torch
backend and the per-token oracle."""

import os

# The interpreter mode is fixed when a kernel is defined: set it before anything imports triton.
os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tandem.modular_kernels import (  # noqa: E402
    MOE_BACKENDS,
    ActivationFormat,
    ExpertTokens,
    TorchBatchedExperts,
    TorchExperts,
    build_moe_kernel,
    dequantize_fp8,
    quantize_fp8_per_token_group,
    select_experts,
    torch_moe_reference,
)
from tandem.modular_kernels.experts_triton import (  # noqa: E402
    TritonBatchedExperts,
    TritonExperts,
    align_pairs_by_expert,
)

ATOL = 1e-4
RTOL = 1e-4


def make_weights(num_experts, hidden, inter, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w1.to(dtype), w2.to(dtype)


def make_routing(num_tokens, num_experts, top_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    return select_experts(logits, top_k, renormalize=True)


def standard_tokens(x, topk_weights, topk_ids, scales=None, dtype=None):
    return ExpertTokens(
        x, scales, dtype or x.dtype, topk_ids=topk_ids, topk_weights=topk_weights
    )


def check_standard(x, w1, w2, topk_weights, topk_ids):
    tokens = standard_tokens(x, topk_weights, topk_ids)
    out = TritonExperts().apply(tokens, w1, w2)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, TorchExperts().apply(tokens, w1, w2), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, torch_moe_reference(x, w1, w2, topk_weights, topk_ids), atol=ATOL, rtol=RTOL)
    return out


# ---------------------------------------------------------------------------- alignment


def test_align_pairs_by_expert_blocks_hold_one_expert():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [-1, -1], [2, 3]])
    block_m = 4
    sorted_ids, block_expert = align_pairs_by_expert(ids, 4, block_m)
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    assert sorted_ids.numel() == block_expert.numel() * block_m
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        real = rows[rows < num_pairs]
        if e < 0:
            assert real.numel() == 0
            continue
        assert (flat[real] == e).all()
        seen += real.tolist()
    valid = (flat >= 0).nonzero().flatten().tolist()
    assert sorted(seen) == valid  # every routed pair exactly once, no -1 pairs
    # experts with no pairs get no block; used blocks come first in expert order
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and 1 not in used


def test_align_pairs_by_expert_has_no_host_sync_and_replays_from_a_graph():
    """No host read of a device value (torch.bincount reads min and max on the host on
    CUDA): the CPU graph refuses such ops, so a capture proves it, and a replay follows
    new ids."""
    from tandem.platform.cpu_graph import CpuGraph

    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [-1, -1], [2, 3]])
    graph = CpuGraph()
    static_ids = ids.clone()
    graph.capture(lambda: align_pairs_by_expert(static_ids, 4, 4))
    new_ids = torch.tensor([[1, 3], [3, 3], [-1, 0], [1, 1], [0, -1]])
    static_ids.copy_(new_ids)
    replayed = graph.replay()
    for got, want in zip(replayed, align_pairs_by_expert(new_ids, 4, 4)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------- standard


@pytest.mark.parametrize(
    "num_experts,hidden,inter,num_tokens,top_k",
    [(4, 64, 32, 7, 2), (3, 48, 24, 5, 3), (2, 128, 64, 4, 1)],
)
def test_standard_random_routing(num_experts, hidden, inter, num_tokens, top_k):
    w1, w2 = make_weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = make_routing(num_tokens, num_experts, top_k)
    check_standard(x, w1, w2, topk_weights, topk_ids)


def test_each_gemm_launches_with_its_own_tile(monkeypatch):
    """gpu-review-3 G10: GEMM 1 (gate/up: N = I, K = H) and GEMM 2 (down: N = H, K = I) take
    their own tile (block_m shared), in both formats; the output is unchanged."""
    from types import SimpleNamespace

    from tandem.modular_kernels import experts_triton
    from tandem.modular_kernels.tile_tables import ExpertTiles, TileConfig

    real = experts_triton._kernels(True)
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages")})
                self.kernel[grid](*args, **kwargs)

            return launch

    spy = SimpleNamespace(triton=real.triton, grouped_gemm=Recorder(real.grouped_gemm), masked_gemm=Recorder(real.masked_gemm))
    monkeypatch.setattr(experts_triton, "_kernels", lambda interpret: spy)
    tiles = ExpertTiles(TileConfig(16, 16, 32, 4, 2), TileConfig(16, 32, 16, 4, 3))
    w1, w2 = make_weights(4, 64, 32)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    topk_weights, topk_ids = make_routing(7, 4, 2)
    tokens = standard_tokens(x, topk_weights, topk_ids)

    out = TritonExperts(tiles=tiles).apply(tokens, w1, w2)

    want = [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_stages": 2},
            {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 3}]  # fmt: skip
    assert launches == want
    torch.testing.assert_close(out, torch_moe_reference(x, w1, w2, topk_weights, topk_ids), atol=ATOL, rtol=RTOL)
    launches.clear()
    slots = ExpertTokens(torch.randn(4, 8, 64), None, torch.float32, expert_num_tokens=torch.tensor([3, 0, 8, 1]))
    TritonBatchedExperts(tiles=tiles).apply(slots, w1, w2)
    assert launches == want


def test_standard_all_tokens_to_one_expert_spans_several_blocks():
    # 20 tokens on expert 1 fill more than one 16-row block; experts 0, 2, 3 get none.
    w1, w2 = make_weights(4, 32, 16)
    x = torch.randn(20, 32)
    topk_ids = torch.full((20, 1), 1)
    topk_weights = torch.rand(20, 1) + 0.5
    check_standard(x, w1, w2, topk_weights, topk_ids)


def test_standard_expert_with_zero_tokens():
    w1, w2 = make_weights(4, 32, 16)
    x = torch.randn(6, 32)
    topk_weights, topk_ids = make_routing(6, 3, 2)  # ids only in [0, 3): expert 3 idle
    assert not (topk_ids == 3).any()
    check_standard(x, w1, w2, topk_weights, topk_ids)


def test_standard_minus_one_ids_contribute_nothing():
    w1, w2 = make_weights(4, 32, 16)
    x = torch.randn(5, 32)
    topk_weights, topk_ids = make_routing(5, 4, 2)
    topk_ids[0, 1] = -1
    topk_ids[2] = -1  # a token with no local expert: its row is zero
    topk_ids[4, 0] = -1
    out = check_standard(x, w1, w2, topk_weights, topk_ids)
    assert torch.count_nonzero(out[2]) == 0


def test_standard_fp8_input():
    hidden = 128
    w1, w2 = make_weights(4, hidden, 32)
    x = torch.randn(6, hidden)
    q, scales = quantize_fp8_per_token_group(x)
    topk_weights, topk_ids = make_routing(6, 4, 2)
    tokens = standard_tokens(q, topk_weights, topk_ids, scales=scales, dtype=torch.float32)
    out = TritonExperts().apply(tokens, w1, w2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, TorchExperts().apply(tokens, w1, w2), atol=ATOL, rtol=RTOL)
    x_dq = dequantize_fp8(q, scales, torch.float32)
    torch.testing.assert_close(out, torch_moe_reference(x_dq, w1, w2, topk_weights, topk_ids), atol=ATOL, rtol=RTOL)


def test_standard_half_precision_dtypes():
    # bfloat16 runs through float32 operands under the interpreter (triton#11584).
    for dtype, tol in [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)]:
        w1, w2 = make_weights(4, 32, 16, dtype=dtype)
        x = torch.randn(5, 32).to(dtype)
        topk_weights, topk_ids = make_routing(5, 4, 2)
        tokens = standard_tokens(x, topk_weights, topk_ids)
        out = TritonExperts().apply(tokens, w1, w2)
        assert out.dtype == dtype
        torch.testing.assert_close(
            out.float(), TorchExperts().apply(tokens, w1, w2).float(), atol=tol, rtol=tol
        )


def test_standard_non_contiguous_weights_and_no_tokens():
    w1_t = torch.randn(3, 32, 2 * 16) / 32**0.5  # stored [E, H, 2I]; passed as a view
    w2_t = torch.randn(3, 16, 32) / 16**0.5
    w1, w2 = w1_t.transpose(1, 2), w2_t.transpose(1, 2)
    x = torch.randn(4, 32)
    topk_weights, topk_ids = make_routing(4, 3, 2)
    check_standard(x, w1, w2, topk_weights, topk_ids)

    empty = standard_tokens(torch.empty(0, 32), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert TritonExperts().apply(empty, w1, w2).shape == (0, 32)


# ---------------------------------------------------------------------------- masked


def masked_tokens(num_experts, max_tokens, hidden, counts, seed=3):
    x = torch.randn(num_experts, max_tokens, hidden, generator=torch.Generator().manual_seed(seed))
    # rows past the counts hold garbage (a reused buffer): it must not leak into the output
    return x, torch.tensor(counts, dtype=torch.int32)


def check_masked(tokens, w1, w2):
    out = TritonBatchedExperts().apply(tokens, w1, w2)
    num_experts, max_tokens, hidden = tokens.hidden.shape
    assert out.shape == (num_experts, max_tokens, hidden) and out.dtype == tokens.dtype
    torch.testing.assert_close(out, TorchBatchedExperts().apply(tokens, w1, w2), atol=ATOL, rtol=RTOL)
    x = tokens.dequantized()
    for e, count in enumerate(tokens.expert_num_tokens.tolist()):
        assert torch.count_nonzero(out[e, count:]) == 0
        if count:
            ones = torch.ones(count, 1)
            ref = torch_moe_reference(x[e, :count], w1, w2, ones, torch.full((count, 1), e))
            torch.testing.assert_close(out[e, :count], ref, atol=ATOL, rtol=RTOL)
    return out


@pytest.mark.parametrize("hidden,inter", [(64, 32), (48, 24)])
def test_masked_counts_zero_partial_full(hidden, inter):
    # max_tokens 20 > block_m 16: expert 2 fills two M-blocks, expert 1 stops inside the first.
    w1, w2 = make_weights(4, hidden, inter)
    x, counts = masked_tokens(4, 20, hidden, [0, 5, 20, 17])
    check_masked(ExpertTokens(x, None, x.dtype, expert_num_tokens=counts), w1, w2)


def test_masked_all_zero_counts():
    w1, w2 = make_weights(2, 32, 16)
    x, counts = masked_tokens(2, 4, 32, [0, 0])
    out = check_masked(ExpertTokens(x, None, x.dtype, expert_num_tokens=counts), w1, w2)
    assert torch.count_nonzero(out) == 0


def test_masked_fp8_input():
    w1, w2 = make_weights(3, 128, 32)
    x, counts = masked_tokens(3, 6, 128, [6, 0, 2])
    q, scales = quantize_fp8_per_token_group(x)
    check_masked(ExpertTokens(q, scales, torch.float32, expert_num_tokens=counts), w1, w2)


# ---------------------------------------------------------------------------- factory and errors


def test_registered_in_factory():
    assert MOE_BACKENDS["triton"][ActivationFormat.STANDARD].endswith(":TritonExperts")
    assert MOE_BACKENDS["triton"][ActivationFormat.MASKED].endswith(":TritonBatchedExperts")


@pytest.mark.parametrize("use_fp8", [False, True])
def test_build_moe_kernel_local_triton_matches_oracle(use_fp8):
    num_experts, hidden, inter, top_k = 4, 128, 32, 2
    kernel = build_moe_kernel(
        "local", "triton", num_experts=num_experts, top_k=top_k, hidden_size=hidden, use_fp8_dispatch=use_fp8
    )
    assert isinstance(kernel.experts, TritonExperts)
    w1, w2 = make_weights(num_experts, hidden, inter)
    x = torch.randn(6, hidden)
    topk_weights, topk_ids = make_routing(6, num_experts, top_k)
    out = kernel(x, w1, w2, topk_weights, topk_ids)
    if use_fp8:
        q, scales = quantize_fp8_per_token_group(x)
        x = dequantize_fp8(q, scales, torch.float32)
    torch.testing.assert_close(out, torch_moe_reference(x, w1, w2, topk_weights, topk_ids), atol=ATOL, rtol=RTOL)


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    w1, w2 = make_weights(2, 32, 16)
    topk_weights, topk_ids = make_routing(3, 2, 1)
    standard = standard_tokens(torch.randn(3, 32), topk_weights, topk_ids)
    x, counts = masked_tokens(2, 4, 32, [1, 2])
    masked = ExpertTokens(x, None, x.dtype, expert_num_tokens=counts)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonExperts().apply(standard, w1, w2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonBatchedExperts().apply(masked, w1, w2)


def test_missing_triton_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    for cls in (TritonExperts, TritonBatchedExperts):
        with pytest.raises(ImportError, match=r"pip install 'tandem\[gpu\]'"):
            cls()
