"""The last step of the grouped-GEMM experts: each token's output is the sum of its top-k
pairs' rows (`y [T*K, H]`, float32, each already weighted), in the model's dtype, plus the
shared experts' output where it is ready.

One Triton kernel instead of a zero fill, a sum and a cast (gpu-review-3 G8): it reads only
the pairs whose expert a GEMM block held (a local id in `[0, E)`; -1, another rank's expert,
is skipped), so the GEMM's output need not be zeroed first, and it adds a token's pairs in k
order in float32 and rounds once. With `shared` it also adds the shared experts' output,
where a kernel of its own added it after, with that add's roundings: the routed sum rounded
to the model's dtype, then `routed + shared` in float32 rounded again (as torch adds two
bfloat16 tensors), so the layer's output keeps its bits."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.platform import triton_utils

_BLOCK = 1024


def _define(triton) -> SimpleNamespace:
    tl = triton.language

    @triton.jit
    def sum_pairs_kernel(
        y_ptr, ids_ptr, out_ptr, shared_ptr, H, num_experts, stride_sm, stride_sh,
        TOP_K: tl.constexpr, ADD_SHARED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + token * TOP_K + k)
            # A pair no block held reads no column: its row was never written.
            width = tl.where((expert >= 0) & (expert < num_experts), H, 0)
            acc += tl.load(y_ptr + (token * TOP_K + k) * H + cols, mask=cols < width, other=0.0)
        if ADD_SHARED:
            # The separate add's roundings: the routed sum in the output dtype, then the add.
            shared = tl.load(shared_ptr + token * stride_sm + cols * stride_sh, mask=cols < H, other=0.0)
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + shared.to(tl.float32)
        tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)

    return SimpleNamespace(sum_pairs=sum_pairs_kernel)


def sum_pairs(
    y: torch.Tensor, ids: torch.Tensor, num_experts: int, dtype: torch.dtype, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """`out[t] = sum over k of y[t * K + k]` for the pairs whose id lies in `[0, num_experts)`,
    as `dtype` (`y [T*K, H]` float32 contiguous, `ids [T, K]`); rows of other pairs are never
    read. With `shared` (`[T, H]` in `dtype`, any strides): `out[t] = (that sum as dtype) +
    shared[t]`, bit for bit what adding the two tensors after gives."""
    num_tokens, top_k = ids.shape
    hidden = y.shape[-1]
    if y.shape[0] != num_tokens * top_k or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"sum_pairs needs y float32 contiguous [{num_tokens * top_k}, H], got {y.dtype} {tuple(y.shape)}")
    if shared is not None and (shared.shape != (num_tokens, hidden) or shared.dtype != dtype):
        raise ValueError(f"sum_pairs adds a shared output [{num_tokens}, {hidden}] {dtype}, got {shared.dtype} {tuple(shared.shape)}")
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((num_tokens, hidden), dtype=dtype, device=y.device)
    if num_tokens and hidden:
        block = min(_BLOCK, triton_utils.next_power_of_2(hidden))
        grid = (num_tokens, -(-hidden // block))
        strides = (0, 0) if shared is None else shared.stride()
        triton_utils.kernels(_define).sum_pairs[grid](
            y, ids, out, y if shared is None else shared, hidden, num_experts, *strides,
            TOP_K=top_k, ADD_SHARED=shared is not None, BLOCK=block,
        )  # fmt: skip
    return out


__all__ = ["sum_pairs"]
