"""The small fused kernels of a MoE layer (SiLU-and-mul, routing top-k, the pair sum), run
under the Triton interpreter against their torch paths, in float32 and bfloat16."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from tandem.modular_kernels import select_experts  # noqa: E402
from tandem.modular_kernels.activation import silu_and_mul, silu_and_mul_torch, silu_and_mul_triton  # noqa: E402
from tandem.modular_kernels.pair_sum import sum_pairs  # noqa: E402
from tandem.modular_kernels.topk_kernel import fused_topk_triton  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_triton_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(3, 5, 2 * 37, generator=g)).to(dtype)  # odd width: a masked tail
    out = silu_and_mul_triton(x)
    assert out.shape == (3, 5, 37) and out.dtype == dtype
    expected = F.silu(x[..., :37].float()) * x[..., 37:].float()
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    torch.testing.assert_close(silu_and_mul_torch(x).float(), expected, **TOL[dtype])
    assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))  # CPU tensors: the torch path


def test_silu_and_mul_triton_reads_strided_rows():
    x = torch.randn(4, 64)[:, :32]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_torch(x), atol=1e-6, rtol=1e-6)


CASES = [
    dict(scoring="softmax", renormalize=False),
    dict(scoring="softmax", renormalize=True),
    dict(scoring="sigmoid", renormalize=True, bias=True, routed_scaling_factor=2.5),
    dict(scoring="sigmoid", renormalize=False),
    # DeepSeek-V2's group-limited greedy and V3's noaux_tc (groups by their best two biased scores).
    dict(scoring="softmax", renormalize=False, num_expert_group=4, topk_group=2),
    dict(scoring="sigmoid", renormalize=True, bias=True, routed_scaling_factor=2.5, num_expert_group=4, topk_group=2),
    dict(scoring="sigmoid", renormalize=True, bias=True, num_expert_group=24, topk_group=5),  # one expert per group
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_fused_topk_matches_select_experts(case, dtype):
    g = torch.Generator().manual_seed(1)
    num_experts, top_k = 24, 5  # neither a power of two: masked experts and slots
    logits = torch.randn(9, num_experts, generator=g).to(dtype)
    options = dict(case)
    bias = torch.randn(num_experts, generator=g) if options.pop("bias", False) else None
    weights, ids = fused_topk_triton(logits, top_k, correction_bias=bias, **options)
    want_weights, want_ids = select_experts(logits, top_k, correction_bias=bias, **options)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (9, top_k)
    # bf16 logits tie: the same experts and weights, tied ones possibly in another order.
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)  # no ties: the same order, best first


def test_fused_topk_of_no_tokens():
    weights, ids = fused_topk_triton(torch.randn(0, 8), 2, renormalize=True)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pair_sum_adds_each_tokens_held_pairs_and_never_reads_the_others(dtype):
    """gpu-review-3 G8: the GEMM's output is not zero-filled, so the rows of pairs no block
    held (another rank's experts, id -1, or past the local experts) hold garbage: NaN here."""
    g = torch.Generator().manual_seed(1)
    tokens, top_k, hidden, experts = 5, 3, 1100, 4  # hidden over one 1024 block: a masked tail
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids[0, 1], ids[2, 0], ids[4] = -1, experts, torch.tensor([-1, -1, 2])
    y = torch.randn(tokens * top_k, hidden, generator=g)
    held = ((ids >= 0) & (ids < experts)).reshape(-1)
    y[~held] = float("nan")
    out = sum_pairs(y, ids, experts, dtype)
    expected = torch.where(held[:, None], y, 0.0).view(tokens, top_k, hidden).sum(1)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    with pytest.raises(ValueError, match="float32 contiguous"):
        sum_pairs(y.to(dtype=torch.float64), ids, experts, dtype)
