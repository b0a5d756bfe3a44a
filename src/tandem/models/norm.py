"""RMSNorm, alone or fused with the residual add before it.

`rms_norm`: on CUDA one Triton kernel (the add + norm kernel without the add), on the CPU one
of tandem's kernels (torch runs its `rms_norm` there as ~10 ATen ops), elsewhere
`torch.nn.functional.rms_norm`. `fused_add_rms_norm` returns `(rms_norm(x + residual), x +
residual)`: one Triton kernel on CUDA, one of tandem's kernels on the CPU, the two torch ops
elsewhere; `add_rms_norm` returns the first alone and keeps nothing of the sum alive (the
final norm). The kernels keep the reference's (HF's `LlamaRMSNorm`) roundings by construction:
the sum is rounded to the model dtype (it is the next residual), normalised in float32, cast
back, then scaled by the weight (tests: bit for bit against transformers' class in bfloat16).
`F.rms_norm` does not (gpu-review-3 G15): torch 2.13 scales by the weight before its one cast
back, which moves ~26 % of bfloat16 outputs by one ulp against HF's class, eager and under
inductor alike (measured on the CPU). It is left where torch.compile traces the model (the
compiled CPU step, whose tokens are kept as they are), in a CPU graph capture and for dtypes
the kernels do not take.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tandem.platform import cpu_kernels, triton_utils


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if triton_utils.use_triton(x) and weight.dtype == x.dtype:
        return rms_norm_triton(x, weight, eps)
    if cpu_kernels.takes_eager(x, weight):
        return cpu_kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _define(triton) -> SimpleNamespace:
    tl = triton.language

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        H, stride_x, stride_res, eps, inner, stride_x_inner,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row: `s = x + res` rounded to the model dtype (without a residual `s = x`, and
        `res_ptr`, `res_out_ptr` unused), `out = w * (s / rms(s))` with HF's roundings:
        normalised in float32, cast to the model dtype, then scaled. Row r of `x` is at
        `(r // inner) * stride_x + (r % inner) * stride_x_inner` (a [tokens, heads, dim] view
        needs no copy)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + (row // inner) * stride_x + (row % inner) * stride_x_inner + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
            total = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * H + cols, total, mask=ok)
            s = total.to(tl.float32)
        else:
            s = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
        normed = (s * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)

    return SimpleNamespace(add_rms_norm=add_rms_norm_kernel)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, keep_sum: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (any device the interpreter or a GPU runs it on); rows of `x` and
    `residual` may be strided, the last dim must be contiguous. `keep_sum=False` (the caller
    drops the sum): the two outputs are separate allocations, so the sum's is freed with it."""
    hidden = x.shape[-1]
    x2, res2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    if x2.stride(-1) != 1 or res2.stride(-1) != 1:
        x2, res2 = x2.contiguous(), res2.contiguous()
    rows = x2.shape[0]
    if keep_sum:  # one allocation for both outputs: [0] the normalised rows, [1] the new residual
        out, total = torch.empty((2, rows, hidden), dtype=residual.dtype, device=x.device)
    else:
        out, total = (torch.empty((rows, hidden), dtype=residual.dtype, device=x.device) for _ in range(2))
    if rows:
        triton_utils.kernels(_define).add_rms_norm[(rows,)](
            x2, res2, weight, out, total, hidden, x2.stride(0), res2.stride(0), eps, 1, 0,
            HAS_RESIDUAL=True, BLOCK=triton_utils.next_power_of_2(hidden),
        )  # fmt: skip
    return out.view(residual.shape), total.view(residual.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The add + norm kernel without the add (any device the interpreter or a GPU runs it
    on): `rms_norm(x)` with HF's roundings, a fresh contiguous output. Rows may be strided
    (a [tokens, heads, dim] view too: Qwen3's per-head q/k norm), the last dim must be
    contiguous."""
    shape, hidden = x.shape, x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:  # [tokens, heads, dim]: rows on a two-level grid, whatever the strides
        rows, inner, stride_x, stride_inner = x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, hidden)  # a view for 1-D and 2-D
        rows, inner, stride_x, stride_inner = x.shape[0], 1, x.stride(0), 0
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if rows:
        triton_utils.kernels(_define).add_rms_norm[(rows,)](
            x, x, weight, out, out, hidden, stride_x, 0, eps, inner, stride_inner,
            HAS_RESIDUAL=False, BLOCK=triton_utils.next_power_of_2(hidden),
        )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`."""
    if triton_utils.use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if x.shape == residual.shape and cpu_kernels.takes_eager(x, residual, weight):
        return cpu_kernels.add_rms_norm(x, residual, weight, eps)
    total = residual + x
    return rms_norm(total, weight, eps), total


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x + residual)` alone, bit for bit `fused_add_rms_norm(...)[0]`, with nothing of
    the sum kept alive (the model's final norm, after which the residual is dead): on CUDA the
    sum is written to a buffer of its own that is freed on return (in a CUDA graph's pool
    too), where `fused_add_rms_norm` returns both halves of one allocation."""
    if triton_utils.use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, keep_sum=False)[0]
    return fused_add_rms_norm(x, residual, weight, eps)[0]


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, normalised in float32 and cast back before the weight. Given a
    `residual`, normalises `x + residual` and returns `(normed, x + residual)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`self(x, residual)[0]` without keeping the sum alive (`add_rms_norm`)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


__all__ = ["RMSNorm", "add_rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_triton", "rms_norm", "rms_norm_triton"]
