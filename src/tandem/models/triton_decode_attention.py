"""Split-KV ("flash-decoding") decode attention over the paged KV cache, in Triton.

A decode batch has one query row per request. Stage 1 runs one program per
(request, head group, KV split): the split is a slice of the request's `seq_len` cached
tokens, read in place through `block_table` (no gather, no float32 copy of the cache), and
the loop over it stops at `seq_len`, so the work follows the tokens actually cached and not
the table's width (a captured graph keeps a table as wide as `max_model_len`). It writes the
split's softmax-normalised partial output and, in a tensor of its own, its log-sum-exp in
float32. Stage 2 merges the splits of each (request, head) by their log-sum-exp. A batch
large enough to fill the GPU with one split per request (`kv_splits_for`) takes one launch:
stage 1 writes the output itself and stage 2 does not run. The semantics follow vLLM's
`decode_attention_fwd_grouped` (two stages, grouped heads, LSE merge).

Both layouts of the cache take the same kernels:
- GQA: K `[blocks, block_size, Hkv, Dk]`, V `[.., Hkv, Dv]`; the query heads of one KV head
  (`Hq // Hkv` of them) share each K/V tile.
- MLA latent (DeepSeek): one KV head whose row is `kv_c (kv_lora_rank) + k_pe (rope)`;
  V is the `kv_c` prefix of the same rows (a view), the query is the absorbed
  `q_latent + q_pe`. Query/key columns past `Dv` (the rope part) are a second, narrower dot.

No host reads of device values: the grid comes from shapes and the split count is a host
setting, so the launch can be captured in a CUDA graph. Operands stay in the model dtype,
accumulators are float32. The split layout depends only on `seq_len` (never on the table's
width), so eager and captured steps give the same bits.

`paged_attention` imports this module (and Triton) only for CUDA caches. Under
`TRITON_INTERPRET=1` the same kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from tandem.platform.device import sm_count
from tandem.platform.triton_utils import interpreting

#: KV splits per request: the most programs one request's tokens are spread over. A short
#: request uses fewer (each split is at least one `BLOCK_N` tile).
DEFAULT_KV_SPLITS = 8
#: Query heads per program (`tl.dot` needs at least 16 rows); a KV head whose group is
#: larger takes several programs.
HEADS_PER_PROGRAM = 16
#: SMs of an H100 / H200, where the device cannot be asked (no driver: fake CUDA).
_DEFAULT_SMS = 132


def kv_splits_for(requests: int, head_programs: int, device: torch.device) -> int:
    """The KV splits that fill the GPU about twice over: `2 x SMs / (requests x head
    programs)` rounded down to a power of 2 in [1, DEFAULT_KV_SPLITS] (gpu-review-3 G5). A
    fixed 8 gave a 256-request batch float32 partials (requests x heads x splits x (Dv + 1))
    as large as the KV they summarise. A host value of the batch's shape only: one per graph
    size, and at most four compiled variants. CPU tensors (the interpreter) keep the default."""
    if device.type != "cuda":
        return DEFAULT_KV_SPLITS
    fill = 2 * (sm_count(device) or _DEFAULT_SMS) // max(requests * head_programs, 1)
    return min(DEFAULT_KV_SPLITS, 1 << max(fill.bit_length() - 1, 0))


def _decode_split(
    q_ptr, q_rope_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, scale,
    stride_qt, stride_qh, stride_qrt, stride_qrh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, stride_or, stride_oh, stride_os, stride_lr, stride_lh,
    kv_group, main_dim, rope_dim, value_dim,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Stage 1 (grid: requests x head groups x splits). Over several splits it writes each
    split's normalised float32 partial to `out_ptr [R, H, S, Dv]` and its log-sum-exp to
    `lse_ptr [R, H, S]`; over one split the split is the whole softmax, so it writes the
    output itself (`[T, H, Dv]` in the output's dtype, zero for a request of length 0) and
    `lse_ptr` is None. The query's columns past `main_dim` (MLA's rope part) come through
    their own pointer: MLA passes its absorbed latent and its rotated rope part apart, so
    nothing concatenates them. `UPCAST`: the interpreter multiplies bfloat16's raw bits in tl.dot
    (triton-lang/triton#11584), so there operands are widened to float32 after the rounding
    the GPU path also does."""
    request = tl.program_id(0)
    programs_per_kv_head = tl.cdiv(kv_group, BLOCK_H)
    kv_head = tl.program_id(1) // programs_per_kv_head
    group_row = (tl.program_id(1) % programs_per_kv_head) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = group_row < kv_group
    heads = kv_head * kv_group + group_row
    # The split's token range; stage 2 derives it the same way.
    seq_len = tl.load(seq_lens_ptr + request)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = per_split * tl.program_id(2)
    end = tl.minimum(start + per_split, seq_len)
    offs_v = tl.arange(0, BLOCK_DV)
    if end > start:
        offs_d = tl.arange(0, BLOCK_D)
        q_rows = q_ptr + request * stride_qt + heads[:, None] * stride_qh
        # Rows of padding heads load zeros: finite scores, never stored.
        q = tl.load(q_rows + offs_d[None, :], mask=head_ok[:, None] & (offs_d[None, :] < main_dim), other=0.0)
        if BLOCK_DR > 0:
            offs_r = tl.arange(0, BLOCK_DR)
            rope_ok = offs_r < rope_dim
            q_rope_rows = q_rope_ptr + request * stride_qrt + heads[:, None] * stride_qrh
            q_rope = tl.load(q_rope_rows + offs_r[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            if BLOCK_DR > 0:
                q_rope = q_rope.to(tl.float32)
        e_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        e_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        table_row = block_table_ptr + request * stride_table
        for first in range(start, end, BLOCK_N):
            offs_n = first + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            block = tl.load(table_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            in_block = offs_n % PAGE_SIZE
            k_rows = k_ptr + block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            k = tl.load(k_rows[None, :] + offs_d[:, None], mask=n_ok[None, :] & (offs_d[:, None] < main_dim), other=0.0)
            v_rows = v_ptr + block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            v = tl.load(v_rows[:, None] + offs_v[None, :], mask=n_ok[:, None] & (offs_v[None, :] < value_dim), other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, k, input_precision=PRECISION)
            if BLOCK_DR > 0:
                k_rope = tl.load(k_rows[None, :] + main_dim + offs_r[:, None], mask=n_ok[None, :] & rope_ok[:, None], other=0.0)
                if UPCAST:
                    k_rope = k_rope.to(tl.float32)
                scores += tl.dot(q_rope, k_rope, input_precision=PRECISION)
            scores = tl.where(n_ok[None, :], scores * scale, float("-inf"))
            new_max = tl.maximum(tl.max(scores, 1), e_max)
            rescale = tl.exp(e_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            # P @ V in the cache dtype, as the GPU does.
            p_cast = p.to(v_ptr.dtype.element_ty).to(v.dtype)
            acc = acc * rescale[:, None] + tl.dot(p_cast, v, input_precision=PRECISION)
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = new_max
        # The output pointers are made here, not before the loop: live across it, they cost
        # registers (101 -> 128 per thread for MLA's bf16 tile on sm_90).
        out_rows = out_ptr + request * stride_or + heads * stride_oh + tl.program_id(2) * stride_os
        out_ok = head_ok[:, None] & (offs_v[None, :] < value_dim)
        tl.store(out_rows[:, None] + offs_v[None, :], (acc / e_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)
        if NUM_SPLITS > 1:
            lse_rows = lse_ptr + request * stride_lr + heads * stride_lh + tl.program_id(2)
            tl.store(lse_rows, e_max + tl.log(e_sum), mask=head_ok)
    elif NUM_SPLITS == 1:
        # No merge follows: a padding request (seq_len 0) writes its zero row here.
        out_rows = out_ptr + request * stride_or + heads * stride_oh
        zero_rows = tl.zeros([BLOCK_H, BLOCK_DV], out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + offs_v[None, :], zero_rows, mask=head_ok[:, None] & (offs_v[None, :] < value_dim))


def _merge_splits(
    partial_ptr, lse_ptr, seq_lens_ptr, out_ptr,
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_ot, stride_oh, value_dim,
    BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Stage 2 (grid: requests x heads), over two splits or more: the log-sum-exp merge."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + request)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < value_dim
    rows = partial_ptr + request * stride_pr + head * stride_ph
    lse_row = lse_ptr + request * stride_lr + head * stride_lh
    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for split in range(NUM_SPLITS):
        # Splits past the request's length wrote nothing (their partial rows are garbage).
        if tl.minimum(per_split * (split + 1), seq_len) > per_split * split:
            part = tl.load(rows + split * stride_ps + offs_v, mask=v_ok, other=0.0)
            lse = tl.load(lse_row + split)
            new_max = tl.maximum(lse, e_max)
            rescale = tl.exp(e_max - new_max)
            weight = tl.exp(lse - new_max)
            acc = acc * rescale + weight * part
            e_sum = e_sum * rescale + weight
            e_max = new_max
    # A padding request (seq_len 0) has no split: its row is zero.
    out = acc / tl.where(e_sum > 0, e_sum, 1.0)
    tl.store(out_ptr + request * stride_ot + head * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=v_ok)


@lru_cache(maxsize=None)
def _kernels(interpret: bool) -> SimpleNamespace:
    """The two stages as Triton kernels in the mode asked for, whatever TRITON_INTERPRET says
    (`triton.jit` would follow the variable): CPU tensors run only interpreted, CUDA ones
    compiled. Triton's own library functions (`tl.max`, `tl.cdiv`) keep the mode triton was
    imported in; compiled kernels take either, interpreted ones need interpreted ones, so CPU
    runs need TRITON_INTERPRET=1 before triton is imported (the tests use a subprocess)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        from triton.runtime.jit import JITFunction as wrap
    return SimpleNamespace(decode_split=wrap(_decode_split), merge_splits=wrap(_merge_splits))


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def split_kernel_meta(
    page_size: int, main_dim: int, rope_dim: int, value_dim: int, dtype: torch.dtype, num_kv_splits: int, interpret: bool
) -> dict:
    """Stage 1's compile-time parameters and launch options (also what the sm_90
    ahead-of-time compile test builds)."""
    upcast = interpret and dtype == torch.bfloat16
    return dict(
        PAGE_SIZE=page_size, BLOCK_H=HEADS_PER_PROGRAM,
        # Wide heads (MLA's 512 + 64) take shorter token tiles: K and V tiles stay in shared memory.
        BLOCK_N=16 if main_dim > 256 else 32,
        BLOCK_D=_pow2(main_dim), BLOCK_DR=_pow2(rope_dim) if rope_dim else 0, BLOCK_DV=_pow2(value_dim),
        NUM_SPLITS=num_kv_splits, UPCAST=upcast,
        PRECISION="ieee" if upcast or dtype == torch.float32 else "tf32",
        # 8 warps: at 4, ptxas spills registers for MLA's bf16 tiles and GQA's float32 ones (sm_90).
        num_warps=8, num_stages=2,
    )


def merge_kernel_meta(split_meta: dict) -> dict:
    keep = ("BLOCK_N", "BLOCK_DV", "NUM_SPLITS")
    return {key: split_meta[key] for key in keep} | {"num_warps": 4, "num_stages": 2}


def _check_operands(query, key_cache, value_cache, seq_lens, block_table) -> None:
    """What the kernels assume and never check (metadata only, no device read): a wrong one
    would be a silent wrong read, not an error."""
    if query.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "triton decode attention got CPU tensors: Triton runs on CPU only under the interpreter "
            "(TRITON_INTERPRET=1)"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV cache's last dimension must be contiguous")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not group over {key_cache.shape[2]} KV heads")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError(
            f"the block table must be int32 [requests, blocks] with contiguous rows, got {block_table.dtype} "
            f"{tuple(block_table.shape)} strides {block_table.stride()}"
        )
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be a contiguous int32 vector, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if seq_lens.shape[0] < block_table.shape[0]:
        raise ValueError(f"{seq_lens.shape[0]} seq_lens for {block_table.shape[0]} block-table rows")


def _split_outputs(out: torch.Tensor, requests: int, num_kv_splits: int):
    """Where stage 1 writes, its LSE tensor, and their strides (request, head, split) and
    (request, head). One split is the whole softmax: stage 1 writes `out` itself, with no
    LSE and no merge after it. Over several, float32 partials `[R, H, S, Dv]` and the LSE in
    a tensor of its own, so each partial row is `Dv` floats (aligned, vectorised), not Dv + 1."""
    if num_kv_splits == 1:
        return out, None, (out.stride(0), out.stride(1), 0), (0, 0)
    _, num_heads, value_dim = out.shape
    partial = torch.empty((requests, num_heads, num_kv_splits, value_dim), dtype=torch.float32, device=out.device)
    lse = torch.empty((requests, num_heads, num_kv_splits), dtype=torch.float32, device=out.device)
    return partial, lse, partial.stride()[:3], lse.stride()[:2]


def _query_parts(query: torch.Tensor, query_rope: torch.Tensor | None, value_dim: int, dtype: torch.dtype):
    """The query's first `min(Dk, Dv)` columns and the rest (MLA's rope part; none for GQA),
    in the cache's dtype with unit column stride: views of `query` when it comes whole."""
    if query_rope is None:
        main_dim = min(query.shape[-1], value_dim)
        query, query_rope = query[..., :main_dim], query[..., main_dim:]
    elif query.shape[-1] != value_dim or query_rope.shape[:2] != query.shape[:2]:
        raise ValueError(
            f"a query given in parts needs its first part as wide as V ({value_dim}) and both parts of one "
            f"[tokens, heads] shape, got {tuple(query.shape)} and {tuple(query_rope.shape)}"
        )
    parts = [part.to(dtype) for part in (query, query_rope)]
    return [part if part.stride(-1) == 1 else part.contiguous() for part in parts]


def triton_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    query_rope: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of `query [T, Hq, Dk]` (row r is request r's one query; rows past
    `block_table.shape[0]` are padding) over K `[blocks, block_size, Hkv, Dk]` and V
    `[.., Hkv, Dv]`, each request reading its first `seq_lens[r]` tokens through
    `block_table[r]`. Returns `[T, Hq, Dv]` in the query's dtype, zero on padding rows and
    on requests of length 0. `query_rope [T, Hq, Dk - Dv]`: the query's columns past `Dv`
    given apart (MLA's rotated part; `query` is then `Dv` wide), so the caller need not
    concatenate them."""
    _check_operands(query, key_cache, value_cache, seq_lens, block_table)
    num_tokens, num_heads = query.shape[:2]
    requests = block_table.shape[0]
    _, page_size, kv_heads, _ = key_cache.shape
    value_dim = value_cache.shape[-1]
    kv_group = num_heads // kv_heads
    out = query.new_empty((num_tokens, num_heads, value_dim))
    if num_tokens > requests:
        out[requests:].zero_()
    if requests == 0:
        return out
    q, q_rope = _query_parts(query, query_rope, value_dim, key_cache.dtype)
    # Key columns past the value width (MLA's rope part) take their own, narrower dot.
    main_dim, rope_dim = q.shape[-1], q_rope.shape[-1]
    head_programs = kv_heads * triton.cdiv(kv_group, HEADS_PER_PROGRAM)
    if num_kv_splits is None:
        num_kv_splits = kv_splits_for(requests, head_programs, query.device)
    # CUDA tensors take the compiled kernels even where TRITON_INTERPRET=1 is set (a test
    # process that also runs interpreted kernels): the interpreter would copy them to the host.
    interpret = query.device.type == "cpu"
    split_meta = split_kernel_meta(page_size, main_dim, rope_dim, value_dim, key_cache.dtype, num_kv_splits, interpret)
    grid = (requests, head_programs, num_kv_splits)
    kernels = _kernels(interpret)
    split_out, lse, split_out_strides, lse_strides = _split_outputs(out, requests, num_kv_splits)
    kernels.decode_split[grid](
        q, q_rope, key_cache, value_cache, block_table, seq_lens, split_out, lse, scale,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_table.stride(0), *split_out_strides, *lse_strides,
        kv_group, main_dim, rope_dim, value_dim, **split_meta,
    )
    if num_kv_splits > 1:
        kernels.merge_splits[(requests, num_heads)](
            split_out, lse, seq_lens, out,
            *split_out_strides, *lse_strides, out.stride(0), out.stride(1), value_dim,
            **merge_kernel_meta(split_meta),
        )
    return out


__all__ = [
    "DEFAULT_KV_SPLITS", "HEADS_PER_PROGRAM", "kv_splits_for", "merge_kernel_meta", "split_kernel_meta",
    "triton_decode_attention",
]  # fmt: skip
