"""Grouped expert GEMMs as Triton kernels, in both activation formats.

STANDARD (`TritonExperts`): the (token, k) pairs are sorted by local expert and padded so
that every block of `block_m` sorted rows belongs to one expert (an "align" step done with
static-shape torch ops, no host sync). One grouped-GEMM kernel then computes
`x[token] @ w1[e]^T` per block, SiLU-and-mul runs in torch, and the same kernel computes
`act @ w2[e]^T` scaled by the routing weight; a scatter-add folds the pairs back into tokens.

MASKED (`TritonBatchedExperts`): one batched kernel over `experts x M-blocks x N-blocks`
that skips every block past `expert_num_tokens[e]` and masks the rows past the count in
the last partial block; outputs are zero-initialised, so skipped rows read as zero.

Triton is imported lazily. On CPU the kernels only run under the Triton interpreter
(`TRITON_INTERPRET=1`); the JIT decorator picks interpreted vs compiled mode when a
kernel is defined, so kernels are built on first use and cached per mode.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tandem.modular_kernels.interfaces import ActivationFormat, Experts, ExpertTokens

_TRITON_MISSING = (
    "the 'triton' moe backend needs the triton package, which is not installed; "
    "install it with: pip install 'tandem[gpu]'"
)

#: dtypes `tl.dot` takes directly; anything else is computed in float32.
_DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _import_triton():
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without triton
        raise ImportError(_TRITON_MISSING) from exc
    return triton


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_device(*tensors: torch.Tensor) -> None:
    if any(t.device.type == "cpu" for t in tensors) and not _interpreting():
        raise RuntimeError(
            "the 'triton' moe backend got CPU tensors: Triton kernels run on CPU only under the "
            "Triton interpreter; set TRITON_INTERPRET=1 in the environment before triton is "
            "imported, or use --moe-backend torch on CPU"
        )


@lru_cache(maxsize=None)
def _kernels(interpret: bool) -> SimpleNamespace:
    """Define the Triton kernels (once per interpreter mode: `triton.jit` fixes the mode at
    definition time)."""
    del interpret  # only the cache key
    triton = _import_triton()
    tl = triton.language

    @triton.jit
    def grouped_gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        weights_ptr,
        sorted_ids_ptr,
        block_expert_ptr,
        num_pairs,
        N,
        K,
        stride_am,
        stride_ak,
        stride_be,
        stride_bn,
        stride_bk,
        stride_cm,
        stride_cn,
        A_ROW_DIV: tl.constexpr,
        MUL_WEIGHT: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """C[pair] = A[pair // A_ROW_DIV] @ B[e]^T (* weight[pair]) for the pairs of one
        sorted block; every block holds pairs of a single expert `e` (-1: padding block)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        a_row = tl.where(row_ok, pair // A_ROW_DIV, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
            acc = acc * w[:, None]
        c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def masked_gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        counts_ptr,
        N,
        K,
        stride_ae,
        stride_am,
        stride_ak,
        stride_be,
        stride_bn,
        stride_bk,
        stride_ce,
        stride_cm,
        stride_cn,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """C[e, :count_e] = A[e, :count_e] @ B[e]^T; blocks past count_e exit (C is zeroed)."""
        expert = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
        count = tl.load(counts_ptr + expert)
        if pid_m * BLOCK_M >= count:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < count
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        e64 = expert.to(tl.int64)
        a_ptrs = a_ptr + e64 * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + e64 * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_ptrs = c_ptr + e64 * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return SimpleNamespace(triton=triton, grouped_gemm=grouped_gemm_kernel, masked_gemm=masked_gemm_kernel)


def _compute_dtype(x: torch.Tensor, *weights: torch.Tensor) -> torch.dtype:
    """The dtype both GEMM operands are cast to: the activation dtype when `tl.dot` takes it
    and the weights share it, float32 otherwise.

    The Triton interpreter keeps bfloat16 as raw uint16 bits and its `tl.dot` multiplies
    those bits (triton-lang/triton#11584, unsupported upstream), so under the interpreter
    bfloat16 operands are promoted to float32 first.
    """
    if x.dtype in _DOT_DTYPES and all(w.dtype == x.dtype for w in weights):
        if x.dtype == torch.bfloat16 and _interpreting():
            return torch.float32
        return x.dtype
    return torch.float32


def _precision(dtype: torch.dtype) -> str:
    # float32 operands: full-precision dot (no tf32), so results match the float32 oracle.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(n: int, cap: int) -> int:
    return max(16, min(cap, 1 << max(0, (n - 1).bit_length())))


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, k) pairs by expert and pad each expert's run to a multiple
    of `block_m`.

    Returns `(sorted_ids [max_padded], block_expert [max_padded // block_m])`: the pair index
    (`token * K + k`) at each sorted row, `N*K` on padding rows; and the expert of each block,
    -1 for blocks past the last expert's run. Ids outside `[0, num_experts)` (-1: another
    rank) are dropped. Shapes depend only on `N*K`, `num_experts` and `block_m` (no host
    sync), so the step can sit inside a captured graph.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # invalid pairs sort last
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]

    # Not torch.bincount: on CUDA it reads the min and max of its input on the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded

    max_padded = (num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_ok = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - start[e]
    dest = torch.where(sorted_ok, padded_start[e] + rank, torch.full_like(rank, max_padded))
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids[dest] = order
    sorted_ids = sorted_ids[:max_padded].contiguous()

    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert.to(torch.int32).contiguous()


class TritonExperts(Experts):
    """STANDARD format: expert-sorted grouped GEMMs in Triton (see the module docstring)."""

    compiles_on_first_use = True

    activation_format = ActivationFormat.STANDARD
    name = "triton"

    def __init__(self, block_m: int = 16, block_n: int = 64, block_k: int = 64):
        _import_triton()
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = tokens.dequantized()
        ids, weights = tokens.topk_ids, tokens.topk_weights
        _check_device(x, w1, w2)
        num_tokens, hidden = x.shape
        top_k = ids.shape[1]
        num_experts, two_i, _ = w1.shape
        inter = two_i // 2
        device = x.device
        out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
        if num_tokens == 0 or top_k == 0 or num_experts == 0:
            return out.to(tokens.dtype)

        kern = _kernels(_interpreting())
        cdiv = kern.triton.cdiv
        dtype = _compute_dtype(x, w1, w2)
        precision = _precision(dtype)
        x = x.to(dtype).contiguous()
        w1c = w1.to(dtype)
        w2c = w2.to(dtype)
        num_pairs = num_tokens * top_k
        flat_weights = weights.reshape(-1).to(device=device, dtype=torch.float32).contiguous()
        sorted_ids, block_expert = align_pairs_by_expert(ids.to(device), num_experts, self.block_m)
        num_blocks = block_expert.numel()

        # GEMM 1: h[pair] = x[pair // K] @ w1[e]^T  ->  [N*K, 2I], rows of skipped pairs stay 0.
        h = torch.zeros((num_pairs, two_i), dtype=torch.float32, device=device)
        bn = _block_n(two_i, self.block_n)
        kern.grouped_gemm[(num_blocks, cdiv(two_i, bn))](
            x, w1c, h, flat_weights, sorted_ids, block_expert,
            num_pairs, two_i, hidden,
            x.stride(0), x.stride(1),
            w1c.stride(0), w1c.stride(1), w1c.stride(2),
            h.stride(0), h.stride(1),
            A_ROW_DIV=top_k, MUL_WEIGHT=False, PRECISION=precision,
            BLOCK_M=self.block_m, BLOCK_N=bn, BLOCK_K=self.block_k,
        )  # fmt: skip

        act = (F.silu(h[:, :inter]) * h[:, inter:]).to(dtype).contiguous()

        # GEMM 2: y[pair] = weight[pair] * act[pair] @ w2[e]^T  ->  [N*K, H].
        y = torch.zeros((num_pairs, hidden), dtype=torch.float32, device=device)
        bn = _block_n(hidden, self.block_n)
        kern.grouped_gemm[(num_blocks, cdiv(hidden, bn))](
            act, w2c, y, flat_weights, sorted_ids, block_expert,
            num_pairs, hidden, inter,
            act.stride(0), act.stride(1),
            w2c.stride(0), w2c.stride(1), w2c.stride(2),
            y.stride(0), y.stride(1),
            A_ROW_DIV=1, MUL_WEIGHT=True, PRECISION=precision,
            BLOCK_M=self.block_m, BLOCK_N=bn, BLOCK_K=self.block_k,
        )  # fmt: skip

        token_of_pair = torch.arange(num_pairs, device=device) // top_k
        out.index_add_(0, token_of_pair, y)
        return out.to(tokens.dtype)


class TritonBatchedExperts(Experts):
    """MASKED format: a Triton batched GEMM that skips rows past each expert's count."""

    compiles_on_first_use = True

    activation_format = ActivationFormat.MASKED
    name = "triton"

    def __init__(self, block_m: int = 16, block_n: int = 64, block_k: int = 64):
        _import_triton()
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k

    def _gemm(self, kern, a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, precision: str) -> torch.Tensor:
        """`[E, M, K] @ [E, N, K]^T -> [E, M, N]` float32, rows past `counts[e]` zero."""
        num_experts, m, k = a.shape
        n = b.shape[1]
        c = torch.zeros((num_experts, m, n), dtype=torch.float32, device=a.device)
        bn = _block_n(n, self.block_n)
        grid = (num_experts, kern.triton.cdiv(m, self.block_m), kern.triton.cdiv(n, bn))
        kern.masked_gemm[grid](
            a, b, c, counts,
            n, k,
            a.stride(0), a.stride(1), a.stride(2),
            b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1), c.stride(2),
            PRECISION=precision, BLOCK_M=self.block_m, BLOCK_N=bn, BLOCK_K=self.block_k,
        )  # fmt: skip
        return c

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = tokens.dequantized()
        _check_device(x, w1, w2)
        num_experts, m, hidden = x.shape
        inter = w1.shape[1] // 2
        if x.numel() == 0:
            return torch.zeros((num_experts, m, hidden), dtype=tokens.dtype, device=x.device)
        kern = _kernels(_interpreting())
        dtype = _compute_dtype(x, w1, w2)
        precision = _precision(dtype)
        # Counts above M would index past the slot; clamp them to the slot size.
        counts = tokens.expert_num_tokens.to(device=x.device, dtype=torch.int32).clamp(0, m).contiguous()

        h = self._gemm(kern, x.to(dtype), w1.to(dtype), counts, precision)
        act = (F.silu(h[..., :inter]) * h[..., inter:]).to(dtype).contiguous()
        out = self._gemm(kern, act, w2.to(dtype), counts, precision)
        return out.to(tokens.dtype)
