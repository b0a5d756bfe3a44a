"""RMSNorm and the fused residual-add + RMSNorm: the Triton kernel (under the interpreter)
against the torch path, which is checked against the reference formula."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.models.norm import RMSNorm, fused_add_rms_norm, fused_add_rms_norm_triton, rms_norm  # noqa: E402

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


def test_triton_add_rms_norm_reads_strided_rows_and_empty_batches():
    x, res, w = inputs(torch.float32, rows=4, hidden=32)
    wide = torch.randn(4, 64)
    wide[:, :32] = x
    normed, total = fused_add_rms_norm_triton(wide[:, :32], res, w, 1e-6)
    torch.testing.assert_close(normed, fused_add_rms_norm(x, res, w, 1e-6)[0], atol=1e-5, rtol=1e-5)
    empty_normed, empty_total = fused_add_rms_norm_triton(x[:0], res[:0], w, 1e-6)
    assert empty_normed.shape == (0, 32) and empty_total.shape == (0, 32)
