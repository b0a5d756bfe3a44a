"""RMSNorm and the fused residual-add + RMSNorm: the Triton kernel (under the interpreter)
against the torch path, which is checked against the reference formula; and the Triton
kernels, with and without the add, against transformers' RMSNorm bit for bit."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.models.norm import (  # noqa: E402
    RMSNorm, fused_add_rms_norm, fused_add_rms_norm_triton, rms_norm, rms_norm_triton,
)
from tests.support.triton_rounding import interpreter_rounds_to_nearest_even  # noqa: E402

pytest.importorskip("triton")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def reference(x, weight, eps):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def inputs(dtype, rows=5, hidden=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return x, res, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference(dtype):
    x, _, w = inputs(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), reference(x, w, 1e-6), **TOL[dtype])
    torch.testing.assert_close(RMSNorm(48, 1e-6, dtype).to(dtype)(x), reference(x, torch.ones(48, dtype=dtype), 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_add_rms_norm_returns_normed_sum_and_sum(dtype):
    x, res, w = inputs(dtype)
    normed, total = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, res + x)
    torch.testing.assert_close(normed, reference(res + x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_add_rms_norm_matches_torch(dtype):
    x, res, w = inputs(dtype, rows=7, hidden=40)  # hidden below the power-of-two block: masked tail
    normed, total = fused_add_rms_norm_triton(x, res, w, 1e-5)
    want_normed, want_total = fused_add_rms_norm(x, res, w, 1e-5)
    assert normed.dtype == dtype and total.dtype == dtype and normed.shape == x.shape
    # The interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest): a tolerance.
    torch.testing.assert_close(total, want_total, **TOL[dtype])
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_is_the_fused_norm_without_the_sum_kept(dtype, monkeypatch):
    """The final norm (`RMSNorm.add_norm`): the bits of `norm(x, residual)[0]`, on the Triton
    path (forced here, as on CUDA) and on the CPU, and an output that owns only its rows
    (`[0]` of the fused kernel's output is a view of one [2, rows, H] allocation)."""
    from tandem.models import norm as norm_module

    x, res, _ = inputs(dtype, rows=6, hidden=40)
    module = RMSNorm(40, 1e-5, dtype)
    with torch.no_grad():
        module.weight.copy_((1 + 0.1 * torch.randn(40)).to(dtype))
    assert torch.equal(module.add_norm(x, res), module(x, res)[0])
    monkeypatch.setattr(norm_module.triton_utils, "use_triton", lambda t: True)
    fused, out = module(x, res)[0], module.add_norm(x, res)
    assert torch.equal(out, fused) and out.shape == x.shape
    assert fused.untyped_storage().nbytes() == 2 * out.untyped_storage().nbytes() == 2 * x.numel() * x.element_size()


def test_triton_add_rms_norm_reads_strided_rows_and_empty_batches():
    x, res, w = inputs(torch.float32, rows=4, hidden=32)
    wide = torch.randn(4, 64)
    wide[:, :32] = x
    normed, total = fused_add_rms_norm_triton(wide[:, :32], res, w, 1e-6)
    torch.testing.assert_close(normed, fused_add_rms_norm(x, res, w, 1e-6)[0], atol=1e-5, rtol=1e-5)
    empty_normed, empty_total = fused_add_rms_norm_triton(x[:0], res[:0], w, 1e-6)
    assert empty_normed.shape == (0, 32) and empty_total.shape == (0, 32)


# -- gpu-review-3 G15: the plain norm on CUDA is the add + norm kernel without the add ------

HF_NORMS = {
    "llama": "transformers.models.llama.modeling_llama:LlamaRMSNorm",
    "deepseek_v2": "transformers.models.deepseek_v2.modeling_deepseek_v2:DeepseekV2RMSNorm",
}


def hf_norm(kind: str, weight: torch.Tensor, eps: float):
    """transformers' RMSNorm class with `weight`: float32, cast back, then the weight."""
    import importlib

    module, name = HF_NORMS[kind].split(":")
    norm = getattr(importlib.import_module(module), name)(weight.shape[0], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """`x` [rows, H] as the model hands it over: contiguous; rows of a wider GEMM output (a
    joined projection's split); [tokens, heads, H] per-head rows of a wider output (Qwen3's q/k
    norm)."""
    rows, hidden = x.shape
    wide = torch.zeros(rows, hidden + 24, dtype=x.dtype)
    wide[:, 8 : 8 + hidden] = x
    heads = torch.zeros(rows // 2, 2 * hidden + 16, dtype=x.dtype)
    heads[:, : 2 * hidden] = x.reshape(rows // 2, 2 * hidden)
    per_head = heads[:, : 2 * hidden].view(rows // 2, 2, hidden)
    assert not wide[:, 8 : 8 + hidden].is_contiguous() and not per_head.is_contiguous()
    return {"contiguous": x, "strided rows": wide[:, 8 : 8 + hidden], "strided heads": per_head}


@pytest.mark.parametrize("kind", list(HF_NORMS))
@pytest.mark.parametrize("hidden", [64, 40])
def test_triton_rms_norm_is_hfs_bit_for_bit_in_bfloat16(kind, hidden, monkeypatch):
    """The kernel without the add rounds as HF's class does: float32, cast to bfloat16, then
    the weight, rounded again; under the interpreter with its casts rounding to nearest even
    as a GPU's do (`tests/support/triton_rounding.py`), every layout, bit for bit."""
    interpreter_rounds_to_nearest_even(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(6, hidden, generator=g)).to(torch.bfloat16)
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    want = hf_norm(kind, weight, 1e-6)(x)
    for name, view in layouts(x).items():
        got = rms_norm_triton(view, weight, 1e-6)
        assert got.shape == view.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.equal(got.reshape(x.shape), want), name


def test_triton_rms_norm_is_the_formula_bit_for_bit_in_float32():
    """float32, on inputs whose sum of squares is exact in any order (multiples of 1/8): the
    formula `w * (x / sqrt(mean(x^2) + eps))`, bit for bit, every layout. (Against HF's class
    the kernel differs in the last bits only: torch sums in another order and takes `rsqrt`;
    there is no cast in float32 for the roundings to differ on.)"""
    g = torch.Generator().manual_seed(4)
    hidden, eps = 48, 1e-6
    x = torch.randint(-24, 25, (6, hidden), generator=g).float() / 8
    weight = 1 + 0.5 * torch.randn(hidden, generator=g)
    mean_square = x.pow(2).sum(-1, keepdim=True) / hidden + eps
    # The formula with IEEE's roundings: torch 2.13's float32 sqrt is not correctly rounded on
    # every CPU (1 ulp off on AMD EPYC with AVX-512); in float64, rounded once, it is.
    root = torch.sqrt(mean_square.double()).float()
    want = weight * (x * (1 / root))
    for name, view in layouts(x).items():
        assert torch.equal(rms_norm_triton(view, weight, eps).reshape(x.shape), want), name
    for kind in HF_NORMS:
        torch.testing.assert_close(rms_norm_triton(x, weight, eps), hf_norm(kind, weight, eps)(x), rtol=2e-7, atol=0)


def test_triton_add_rms_norm_is_hfs_bit_for_bit_in_bfloat16(monkeypatch):
    """With the add: the sum rounded to bfloat16, then HF's norm of it."""
    interpreter_rounds_to_nearest_even(monkeypatch)
    x, res, w = inputs(torch.bfloat16, rows=6, hidden=64)
    normed, total = fused_add_rms_norm_triton(x, res, w, 1e-6)
    assert torch.equal(total, res + x)
    assert torch.equal(normed, hf_norm("llama", w, 1e-6)(res + x))


def test_triton_rms_norm_of_no_rows_and_of_one_vector():
    weight = torch.ones(32)
    assert rms_norm_triton(torch.randn(0, 32), weight, 1e-6).shape == (0, 32)
    assert rms_norm_triton(torch.randn(0, 4, 32), weight, 1e-6).shape == (0, 4, 32)
    one = torch.randn(32)
    torch.testing.assert_close(rms_norm_triton(one, weight, 1e-6), reference(one, weight, 1e-6), atol=1e-6, rtol=1e-6)


def test_the_cpu_kernels_are_hfs_bit_for_bit_in_bfloat16():
    """tandem's CPU norm kernels round as HF's class does too (torch's own `F.rms_norm` does
    not in torch 2.13: it scales before its one cast; the torch path is what torch.compile
    traces)."""
    from tandem.platform import cpu_kernels

    x, res, w = inputs(torch.bfloat16, rows=6, hidden=64)
    assert cpu_kernels.takes_eager(x, w), "tandem's CPU kernels are not built here"
    assert torch.equal(rms_norm(x, w, 1e-6), hf_norm("llama", w, 1e-6)(x))
    normed, total = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, res + x) and torch.equal(normed, hf_norm("llama", w, 1e-6)(res + x))
