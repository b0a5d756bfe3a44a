"""RoPE and the KV-cache write as one Triton kernel (CUDA): per token, the queries are
rotated in place, the rotated key goes straight to its cache slot, and an optional second
row (GQA's value, MLA's latent) is copied to its slot alongside, RMS-normalised on the way
where asked (MLA's `kv_a_layernorm`: no norm kernel, and no copy of the strided latent
that torch's CUDA norm makes first). cos and sin are
read from the model's cache at each token's position, in float32; rows whose slot is
negative (padding) write nothing.

Both layouts of `rope.py`: rotate-half, and interleaved pairs written de-interleaved (evens'
rotation first, then odds'), which moves elements across threads, hence a barrier between
the loads and the in-place stores.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.platform import triton_utils


def _define(triton) -> SimpleNamespace:
    tl = triton.language

    @triton.jit
    def rope_cache_kernel(
        q_ptr, k_ptr, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, src_ptr, src_cache_ptr, src_norm_ptr,
        num_q_heads, num_k_heads, src_width, num_slots,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
        stride_kc_slot, stride_kc_h, stride_src_t, stride_src_slot, src_norm_eps,
        HALF: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE_CACHE: tl.constexpr, COPY_SRC: tl.constexpr,
        NORM_SRC: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SRC: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0)

        # x1, x2: the pair halves (rotate-half: dims d and d + HALF; interleaved: 2d, 2d + 1).
        if INTERLEAVED:
            first, second = 2 * d, 2 * d + 1
        else:
            first, second = d, HALF + d
        q_heads = tl.arange(0, BLOCK_HQ)
        q_ptrs = q_ptr + token * stride_qt + q_heads[:, None] * stride_qh
        q_ok = (q_heads[:, None] < num_q_heads) & (d[None, :] < HALF)
        q1 = tl.load(q_ptrs + first[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_ptrs + second[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q1, q2 = q1 * cos[None, :] - q2 * sin[None, :], q2 * cos[None, :] + q1 * sin[None, :]
        k_heads = tl.arange(0, BLOCK_HK)
        k_ptrs = k_ptr + token * stride_kt + k_heads[:, None] * stride_kh
        k_ok = (k_heads[:, None] < num_k_heads) & (d[None, :] < HALF)
        k1 = tl.load(k_ptrs + first[None, :], mask=k_ok, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptrs + second[None, :], mask=k_ok, other=0.0).to(tl.float32)
        k1, k2 = k1 * cos[None, :] - k2 * sin[None, :], k2 * cos[None, :] + k1 * sin[None, :]
        if INTERLEAVED:
            tl.debug_barrier()
        q_ty = q_ptr.dtype.element_ty
        tl.store(q_ptrs + d[None, :], q1.to(q_ty), mask=q_ok)
        tl.store(q_ptrs + HALF + d[None, :], q2.to(q_ty), mask=q_ok)
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + token, mask=token < num_slots, other=-1).to(tl.int64)
            if slot >= 0:
                c_ptrs = k_cache_ptr + slot * stride_kc_slot + k_heads[:, None] * stride_kc_h
                c_ty = k_cache_ptr.dtype.element_ty
                tl.store(c_ptrs + d[None, :], k1.to(c_ty), mask=k_ok)
                tl.store(c_ptrs + HALF + d[None, :], k2.to(c_ty), mask=k_ok)
                if COPY_SRC:
                    cols = tl.arange(0, BLOCK_SRC)
                    row = tl.load(src_ptr + token * stride_src_t + cols, mask=cols < src_width, other=0.0)
                    if NORM_SRC:
                        # rms_norm's roundings: normalised in float32, cast back, then weighted.
                        x = row.to(tl.float32)
                        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / src_width + src_norm_eps)
                        normed = (x * inv_rms).to(src_ptr.dtype.element_ty).to(tl.float32)
                        weight = tl.load(src_norm_ptr + cols, mask=cols < src_width, other=0.0).to(tl.float32)
                        row = (normed * weight).to(src_ptr.dtype.element_ty)
                    dst = src_cache_ptr + slot * stride_src_slot + cols
                    tl.store(dst, row.to(src_cache_ptr.dtype.element_ty), mask=cols < src_width)
        else:
            k_ty = k_ptr.dtype.element_ty
            tl.store(k_ptrs + d[None, :], k1.to(k_ty), mask=k_ok)
            tl.store(k_ptrs + HALF + d[None, :], k2.to(k_ty), mask=k_ok)

    return SimpleNamespace(rope_cache=rope_cache_kernel)


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """`[blocks, block_size, ...]` as `[slots, ...]` (a view)."""
    return cache.view(-1, *cache.shape[2:])


def rope_and_cache_triton(
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    interleaved: bool,
    slot_mapping: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    copy: tuple[torch.Tensor, torch.Tensor] | None = None,
    normalise_copy: tuple[torch.Tensor, float] | None = None,
) -> None:
    """Rotate `q [T, Hq, D]` in place; then either rotate `k [T, Hk, D]` in place, or (given
    `slot_mapping` and `k_cache [blocks, block_size, Hk, >=D]`, a view ending at the rotary
    dims) write the rotated key to its slot and copy `copy = (rows [T, W], cache)` to the
    same slot (`rows [T, ...]` and `cache [blocks, block_size, ...]` with the same trailing
    shape, each row's elements contiguous), RMS-normalised over the whole row first with
    `normalise_copy = (weight, eps)` when given. Last dims contiguous."""
    num_tokens, num_q_heads, dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_and_cache_triton needs the rotary dims contiguous in q and k")
    write = slot_mapping is not None
    k_rows = _slot_rows(k_cache) if write else k
    if copy is not None:
        src, src_rows = copy[0].reshape(num_tokens, -1), _slot_rows(copy[1]).flatten(1)
        if src.stride(-1) != 1 or src_rows.stride(-1) != 1:
            raise ValueError("rope_and_cache_triton copies rows whose elements are contiguous")
    else:
        src, src_rows = q, q  # unread: nothing to copy
    if normalise_copy is not None and copy is None:
        raise ValueError("rope_and_cache_triton normalises only rows it copies")
    norm_weight, norm_eps = normalise_copy if normalise_copy is not None else (q, 0.0)  # unread without a norm
    if num_tokens == 0:
        return
    next_pow2 = triton_utils.next_power_of_2
    triton_utils.kernels(_define).rope_cache[(num_tokens,)](
        q, k, positions, cos_sin_cache, slot_mapping if write else positions, k_rows, src, src_rows, norm_weight,
        num_q_heads, k.shape[1], src.shape[-1], slot_mapping.shape[0] if write else 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        k_rows.stride(0), k_rows.stride(1), src.stride(0), src_rows.stride(0), norm_eps,
        HALF=dim // 2, INTERLEAVED=interleaved, WRITE_CACHE=write, COPY_SRC=copy is not None,
        NORM_SRC=normalise_copy is not None,
        BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_D=next_pow2(dim // 2),
        BLOCK_SRC=next_pow2(src.shape[-1]),
    )  # fmt: skip


__all__ = ["rope_and_cache_triton"]
