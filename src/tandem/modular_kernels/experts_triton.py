"""Grouped expert GEMMs as Triton kernels, in both activation formats.

STANDARD (`TritonExperts`): the (token, k) pairs are sorted by local expert and padded so
that every block of `block_m` sorted rows belongs to one expert (the align step,
`moe_align.py`: one Triton program on CUDA, no sort, no host sync). One grouped-GEMM kernel
then computes `silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T)` per block, the same kernel
computes `act @ w2[e]^T` scaled by the routing weight, and a fixed-order sum over each
token's k rows folds the pairs back into tokens (`pair_sum.py`: one kernel that skips the
pairs of other ranks' experts, so the GEMM's output is never zero-filled, and adds the
shared experts' output when the modular kernel hands it over). Tile sizes come
from `tile_tables.py`, one per GEMM (`block_m` shared); `benchmarks/tune_moe_configs.py`
times each GEMM alone through `gate_up_gemm` and `down_gemm`.

MASKED (`TritonBatchedExperts`): one batched kernel over `experts x M-blocks x N-blocks`
that skips every block past `expert_num_tokens[e]` and masks the rows past the count in
the last partial block; outputs are zero-initialised, so skipped rows read as zero.

Triton is imported lazily. On CPU the kernels only run under the Triton interpreter
(`TRITON_INTERPRET=1`); the JIT decorator picks interpreted vs compiled mode when a
kernel is defined, so kernels are built on first use and cached per mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import torch

from tandem.modular_kernels.activation import silu_and_mul
from tandem.modular_kernels.interfaces import ActivationFormat, Experts, ExpertTokens
from tandem.modular_kernels.moe_align import align_pairs_by_expert
from tandem.modular_kernels.pair_sum import sum_pairs
from tandem.modular_kernels.tile_tables import ExpertTiles, TileConfig, expert_tiles
from tandem.platform.triton_utils import import_triton, interpreting


#: dtypes `tl.dot` takes directly; anything else is computed in float32.
_DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_device(*tensors: torch.Tensor) -> None:
    if any(t.device.type == "cpu" for t in tensors) and not interpreting():
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
    triton = import_triton()
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
        GATED: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """C[pair] = A[pair // A_ROW_DIV] @ B[e]^T (* weight[pair]) for the pairs of one
        sorted block; every block holds pairs of a single expert `e` (-1: padding block).
        GATED: B has 2N rows (gate, then up) and C[pair] = silu(A @ gate^T) * (A @ up^T),
        both accumulated in float32 before the activation."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        pair = tl.where(row_ok, pair, 0).to(tl.int64)
        a_row = pair // A_ROW_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                up = tl.load(b_ptrs + N * stride_bn, mask=col_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
                up_acc = tl.dot(a, up, up_acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * up_acc
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
        if x.dtype == torch.bfloat16 and interpreting():
            return torch.float32
        return x.dtype
    return torch.float32


def _precision(dtype: torch.dtype) -> str:
    # float32 operands: full-precision dot (no tf32), so results match the float32 oracle.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(n: int, cap: int) -> int:
    return max(16, min(cap, 1 << max(0, (n - 1).bit_length())))


class TileChoice:
    """Tiles from the tuned table (`tile_tables.py`), each size overridable by hand (for both
    GEMMs), or fixed `tiles` (the tuner's candidates)."""

    def __init__(self, block_m=None, block_n=None, block_k=None, tiles: ExpertTiles | None = None):
        self.overrides = {k: v for k, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)) if v}
        self.fixed = tiles

    def pick(self, num_experts: int, n: int, k: int, num_tokens: int, top_k: int, device: torch.device) -> ExpertTiles:
        tiles = self.fixed or expert_tiles(num_experts, n, k, num_tokens, top_k, device)
        if not self.overrides:
            return tiles
        return ExpertTiles(*(TileConfig(**{**tile.as_dict(), **self.overrides}) for tile in (tiles.gemm1, tiles.gemm2)))


@dataclass(frozen=True)
class SortedPairs:
    """The (token, k) pairs sorted into blocks of one expert each (the align step), with
    their float32 routing weights: what both grouped GEMMs walk."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    weights: torch.Tensor
    top_k: int

    @property
    def num_pairs(self) -> int:
        return self.weights.shape[0]


def sort_pairs(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    sorted_ids, block_expert = align_pairs_by_expert(ids, num_experts, block_m)
    flat_weights = weights.reshape(-1).to(device=ids.device, dtype=torch.float32).contiguous()
    return SortedPairs(sorted_ids, block_expert, flat_weights, ids.shape[1])


def _grouped_gemm(a, b, c, pairs: SortedPairs, tile: TileConfig, *, gated: bool) -> None:
    kern = _kernels(interpreting())
    n = b.shape[1] // 2 if gated else b.shape[1]
    bn = _block_n(n, tile.block_n)
    kern.grouped_gemm[(pairs.block_expert.numel(), kern.triton.cdiv(n, bn))](
        a, b, c, pairs.weights, pairs.sorted_ids, pairs.block_expert,
        pairs.num_pairs, n, a.shape[1],
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        A_ROW_DIV=pairs.top_k if gated else 1, MUL_WEIGHT=not gated, GATED=gated, PRECISION=_precision(a.dtype),
        BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def gate_up_gemm(x: torch.Tensor, w1: torch.Tensor, pairs: SortedPairs, tile: TileConfig) -> torch.Tensor:
    """GEMM 1 with SiLU-and-mul: `act[pair] = silu(x @ gate^T) * (x @ up^T)`, `[pairs, I]` in
    x's dtype. Rows of pairs no block holds (another rank's experts) are never read: no zero fill."""
    act = torch.empty((pairs.num_pairs, w1.shape[1] // 2), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w1, act, pairs, tile, gated=True)
    return act


def down_gemm(act: torch.Tensor, w2: torch.Tensor, pairs: SortedPairs, tile: TileConfig) -> torch.Tensor:
    """GEMM 2: `y[pair] = weight[pair] * act[pair] @ w2^T`, `[pairs, H]` float32; rows of
    pairs no block holds are left unwritten (the pair sum never reads them)."""
    y = torch.empty((pairs.num_pairs, w2.shape[1]), dtype=torch.float32, device=act.device)
    _grouped_gemm(act, w2, y, pairs, tile, gated=False)
    return y


class TritonExperts(Experts):
    """STANDARD format: expert-sorted grouped GEMMs in Triton (see the module docstring)."""

    compiles_on_first_use = True

    activation_format = ActivationFormat.STANDARD
    name = "triton"

    def __init__(
        self, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None, *,
        tiles: ExpertTiles | None = None,
    ):  # fmt: skip
        import_triton()
        self.tiles = TileChoice(block_m, block_n, block_k, tiles)

    def adds_shared_output(self, device: torch.device) -> bool:
        return device.type == "cuda" or interpreting()

    def apply(
        self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor, *, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As `Experts.apply`; `shared` (`[N, H]`, the tokens' dtype) is added in the pair sum,
        with the roundings of adding it after (gpu-review-3 G8)."""
        x = tokens.dequantized()
        ids, weights = tokens.topk_ids, tokens.topk_weights
        _check_device(x, w1, w2)
        num_tokens, hidden = x.shape
        top_k = ids.shape[1]
        num_experts, two_i, _ = w1.shape
        device = x.device
        if num_tokens == 0 or top_k == 0 or num_experts == 0:
            routed = torch.zeros((num_tokens, hidden), dtype=tokens.dtype, device=device)
            return routed if shared is None else routed + shared
        dtype = _compute_dtype(x, w1, w2)
        tiles = self.tiles.pick(num_experts, two_i // 2, hidden, num_tokens, top_k, device)
        ids = ids.to(device)
        pairs = sort_pairs(ids, weights, num_experts, tiles.gemm1.block_m)
        act = gate_up_gemm(x.to(dtype).contiguous(), w1.to(dtype), pairs, tiles.gemm1)
        y = down_gemm(act, w2.to(dtype), pairs, tiles.gemm2)
        # A token's pairs are consecutive rows: a fixed-order sum (no atomics, no index_add).
        return sum_pairs(y, ids, num_experts, tokens.dtype, shared)


class TritonBatchedExperts(Experts):
    """MASKED format: a Triton batched GEMM that skips rows past each expert's count."""

    compiles_on_first_use = True

    activation_format = ActivationFormat.MASKED
    name = "triton"

    def __init__(
        self, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None, *,
        tiles: ExpertTiles | None = None,
    ):  # fmt: skip
        import_triton()
        self.tiles = TileChoice(block_m, block_n, block_k, tiles)

    def _gemm(self, kern, a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, precision: str, tile: TileConfig):
        """`[E, M, K] @ [E, N, K]^T -> [E, M, N]` float32, rows past `counts[e]` zero."""
        num_experts, m, k = a.shape
        n = b.shape[1]
        c = torch.zeros((num_experts, m, n), dtype=torch.float32, device=a.device)
        bn = _block_n(n, tile.block_n)
        grid = (num_experts, kern.triton.cdiv(m, tile.block_m), kern.triton.cdiv(n, bn))
        kern.masked_gemm[grid](
            a, b, c, counts,
            n, k,
            a.stride(0), a.stride(1), a.stride(2),
            b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1), c.stride(2),
            PRECISION=precision, BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
        return c

    def apply(self, tokens: ExpertTokens, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x = tokens.dequantized()
        _check_device(x, w1, w2)
        num_experts, m, hidden = x.shape
        inter = w1.shape[1] // 2
        if x.numel() == 0:
            return torch.zeros((num_experts, m, hidden), dtype=tokens.dtype, device=x.device)
        kern = _kernels(interpreting())
        dtype = _compute_dtype(x, w1, w2)
        precision = _precision(dtype)
        # Counts above M would index past the slot; clamp them to the slot size.
        counts = tokens.expert_num_tokens.to(device=x.device, dtype=torch.int32).clamp(0, m).contiguous()

        # Every expert's slot holds up to M tokens: the masked GEMM's rows per expert.
        tiles = self.tiles.pick(num_experts, inter, hidden, m * num_experts, 1, x.device)
        h = self._gemm(kern, x.to(dtype), w1.to(dtype), counts, precision, tiles.gemm1)
        act = silu_and_mul(h).to(dtype)
        out = self._gemm(kern, act, w2.to(dtype), counts, precision, tiles.gemm2)
        return out.to(tokens.dtype)
