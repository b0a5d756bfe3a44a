"""SiLU-and-mul, `silu(x[..., :I]) * x[..., I:]`: one Triton kernel on CUDA (computed in
float32, rounded once to the input dtype), the two torch ops on CPU (in the input dtype)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tandem.platform import triton_utils

_BLOCK = 1024


def _define(triton) -> SimpleNamespace:
    tl = triton.language

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=ok, other=0.0).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * I + cols, act.to(out_ptr.dtype.element_ty), mask=ok)

    return SimpleNamespace(silu_and_mul=silu_and_mul_kernel)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate then up), got {two_i}")
    inter = two_i // 2
    rows = x.reshape(-1, two_i)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        block = min(_BLOCK, triton_utils.next_power_of_2(inter))
        grid = (rows.shape[0], -(-inter // block))
        triton_utils.kernels(_define).silu_and_mul[grid](rows, out, inter, rows.stride(0), BLOCK=block)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if triton_utils.use_triton(x) else silu_and_mul_torch(x)


__all__ = ["silu_and_mul", "silu_and_mul_torch", "silu_and_mul_triton"]
