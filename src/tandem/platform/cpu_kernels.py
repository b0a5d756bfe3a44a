"""tandem's own CPU kernels (`csrc/cpu_kernels.c`): what a decode step spends its time on, each
in one call where torch runs several ops.

A decode step multiplies a handful of rows by every weight once, so it runs at the speed the
weights stream from memory. oneDNN's packed GEMM reaches ~60 % of this machine's one-thread
read bandwidth there and costs ~10 us of fixed work per call, and the experts cost one call per
expert and projection plus the torch ops between them (gather, activation, weighted sum). These
kernels stream weights packed into column panels with register accumulators, and run a whole
MoE layer's experts (sort by expert, both projections, SiLU-and-mul, weighted sum) in one call;
`benchmarks/cpu_gemm.py` has the figures against oneDNN. The rest of a layer's small work is
one call each as well: decode attention over the paged cache read in place, the rotary
embedding with the cache write, RMSNorm (with the residual add), softmax routing; each ATen op
costs ~5-15 us of dispatch on the CPU, and a layer ran ~50 of them.

The library is compiled from the C source on first use and cached on disk
(`cpu_kernels_build.py`); ctypes releases the GIL for the call (DBO's ubatch threads keep
running). Without a compiler, or with `TANDEM_CPU_KERNELS=0`, `available()` is False and
callers keep their torch paths.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Iterator

import torch

from tandem.platform.cpu_kernels_build import cache_dir, library as _library
from tandem.platform.graph import graph_capture_active

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available() -> bool:
    return _library() is not None


_switched_off = False


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Every caller takes its torch path while inside (benchmarks compare both in one process)."""
    global _switched_off
    before, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = before


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether these operands run here: plain CPU tensors of one dtype the kernels take, outside
    a graph capture (a `CpuGraph` records ATen ops, and a ctypes call would vanish from its
    replays)."""
    if _switched_off:
        return False
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    for tensor in tensors:  # a loop, not all(...): this runs ~40 times a decode step
        if tensor.dtype is not dtype or not tensor.is_cpu or type(tensor) not in _PLAIN_TYPES:
            return False
    return not graph_capture_active() and available()


def takes_eager(*tensors: torch.Tensor) -> bool:
    """`takes`, and not while torch.compile traces: for the small ops inductor fuses into their
    neighbours itself (RMSNorm, softmax routing)."""
    return not torch.compiler.is_compiling() and takes(*tensors)


def _run(op, implementation, *args):
    """`op(*args)` through the dispatcher while anything may watch the ops (torch.compile
    tracing, a dispatch mode: fake tensors, an op counter; the profiler), else the op's
    `implementation` called directly: the dispatcher's round trip into a Python kernel took
    ~9 us a call, a tenth of the tiny Mixtral's decode step over its ~20 calls."""
    if torch._C._len_torch_dispatch_stack() or torch._C._autograd._profiler_enabled() or torch.compiler.is_compiling():
        return op(*args)
    return implementation(*args)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight [N, K]` or stacked experts `[E, N, K]` into column panels (`[..., panels*K*P]`)."""
    library = _library()
    weight = weight.detach().contiguous()
    *lead, n, k = weight.shape
    per = library.tandem_packed_elements(n, k, _DTYPES[weight.dtype])
    flat = weight.reshape(-1, n, k)
    packed = weight.new_empty((flat.shape[0], per))
    for index in range(flat.shape[0]):
        library.tandem_pack(flat[index].data_ptr(), _DTYPES[weight.dtype], n, k, k, packed[index].data_ptr())
    return packed.view(*lead, per) if lead else packed[0]


@lru_cache(maxsize=None)
def uses_amx() -> bool:
    """Whether bfloat16 weights run on AMX tiles here (packed for them, any row count memory-bound)."""
    return available() and bool(_library().tandem_amx())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x [..., K] @ W^T` for the weight `packed` holds (`pack`); x's dtype out (the op
    `tandem::cpu_panel_linear`)."""
    return _run(torch.ops.tandem.cpu_panel_linear, _linear, x, packed, out_features)


def _linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = rows.new_empty((rows.shape[0], out_features))
    status = _library().tandem_linear(
        rows.data_ptr(), _DTYPES[rows.dtype], rows.shape[0], rows.shape[1], packed.data_ptr(),
        _DTYPES[packed.dtype], out_features, out.data_ptr(), _DTYPES[out.dtype],
    )  # fmt: skip
    if status:
        raise MemoryError("tandem_linear could not allocate its scratch")
    return out.view(*x.shape[:-1], out_features)


def moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    intermediate: int,
) -> torch.Tensor:
    """The routed experts' output `[T, K]` for `x [T, K]` (see `tandem_moe`); `w13` / `w2` the
    packed `[E, 2I, K]` / `[E, K, I]` weights. An id outside `[0, E)` adds nothing. One
    dispatcher op (`tandem::cpu_moe`) whenever profilers and op counters watch (`_run`)."""
    return _run(torch.ops.tandem.cpu_moe, _moe, x, topk_ids, topk_weights, w13, w2, intermediate)


def _moe(x, topk_ids, topk_weights, w13, w2, intermediate):
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    status = _library().tandem_moe(
        x.data_ptr(), _DTYPES[x.dtype], x.shape[0], x.shape[1], ids.data_ptr(), weights.data_ptr(), ids.shape[1],
        w13.data_ptr(), w2.data_ptr(), _DTYPES[w13.dtype], w13.shape[0], intermediate, w13.shape[1], w2.shape[1],
        out.data_ptr(), _DTYPES[out.dtype],
    )  # fmt: skip
    if status:
        raise MemoryError("tandem_moe could not allocate its scratch")
    return out


def decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor | None:
    """`query [R, Hq, Dk]`, one row per request, against the paged caches `[blocks, block_size,
    Hkv, D]` read in place through `block_table [R, W]` up to `seq_lens [R]`; `[R, Hq, Dv]` in
    the query's dtype, zeros for a request of length 0 (the op `tandem::cpu_decode_attention`).
    None when a cache's rows are not contiguous in the head dimension, or the two caches are
    laid out over different blocks."""
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or value_cache.shape[:3] != key_cache.shape[:3]:
        return None
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not group over {key_cache.shape[2]} KV heads")
    return _run(torch.ops.tandem.cpu_decode_attention, _decode_attention, query, key_cache, value_cache, block_table,
                seq_lens, scale)


def _decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale):
    requests, num_heads, key_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    value_dim = value_cache.shape[-1]
    query = query.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = query.new_empty((requests, num_heads, value_dim))
    status = _library().tandem_decode_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), _DTYPES[query.dtype], *key_cache.stride()[:3],
        *value_cache.stride()[:3], table.data_ptr(), table.shape[1], lens.data_ptr(), requests, num_heads, kv_heads,
        key_dim, value_dim, block_size, scale, out.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError("tandem_decode_attention could not allocate its scratch")
    return out


def rope_and_cache(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor,
    slot_mapping: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, interleaved: bool,
) -> torch.Tensor:
    """The rotary embedding of `query [T, Hq, D]` and `key [T, Hk, D]` at `positions [T]`
    (angles from `table`, float32 `[P, D]`: cos then sin), the rotated key written to
    `key_cache` and `value [T, Hv, Dv]` to `value_cache` (`[blocks, block_size, heads, dim]`
    views) at `slot_mapping` (rows past it or at slot -1 write nothing): `RotaryEmbedding.
    rotate_and_cache`'s torch path in one call, with the same bits. Returns the rotated query,
    a new contiguous tensor (the op `tandem::cpu_rope_and_cache`)."""
    return _run(torch.ops.tandem.cpu_rope_and_cache, _rope_and_cache, positions, query, key, value, table, slot_mapping,
                key_cache, value_cache, interleaved)


def _rope_and_cache(positions, query, key, value, table, slot_mapping, key_cache, value_cache, interleaved):
    tokens, q_heads, dim = query.shape
    if key.shape[-1] != dim or table.shape[-1] != dim or dim % 2:
        raise ValueError(f"rotary dims differ or are odd: query {dim}, key {key.shape[-1]}, table {table.shape[-1]}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    positions, slots = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
    table = table.to(torch.float32).contiguous()
    out = query.new_empty((tokens, q_heads, dim))
    status = _library().tandem_rope_and_cache(
        query.data_ptr(), *query.stride()[:2], key.data_ptr(), *key.stride()[:2], value.data_ptr(),
        *value.stride()[:2], _DTYPES[query.dtype], positions.data_ptr(), table.data_ptr(), table.shape[0], tokens,
        q_heads, key.shape[1], dim, int(interleaved), slots.data_ptr(), slots.shape[0],
        key_cache.shape[0] * key_cache.shape[1], key_cache.data_ptr(), *key_cache.stride()[:3],
        value_cache.data_ptr(), *value_cache.stride()[:3], value.shape[1], value.shape[2], key_cache.shape[1],
        out.data_ptr(),
    )  # fmt: skip
    if status == -3:
        raise IndexError(f"a position is outside the rotary table's {table.shape[0]} rows")
    if status == -4:
        raise IndexError(f"a slot is outside the cache's {key_cache.shape[0] * key_cache.shape[1]} slots")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, (H,), weight, eps)` as torch computes it (normalised in float32, cast
    back, then scaled by the weight) in one call (the op `tandem::cpu_rms_norm`)."""
    return _run(torch.ops.tandem.cpu_rms_norm, _rms_norm, x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`, the sum rounded to the dtype (the op
    `tandem::cpu_add_rms_norm`)."""
    return _run(torch.ops.tandem.cpu_add_rms_norm, _add_rms_norm, x, residual, weight, eps)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x, residual, weight, eps):
    rows, weight = _rows(x), weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    total = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    added = None if residual is None else _rows(residual)
    _library().tandem_rms_norm(
        rows.data_ptr(), rows.stride(0), None if added is None else added.data_ptr(), 0 if added is None else added.stride(0),
        None if total is None else total.data_ptr(), weight.data_ptr(), _DTYPES[x.dtype], rows.shape[0], rows.shape[1],
        eps, out.data_ptr(),
    )  # fmt: skip
    return out, total


def _rms_norm(x, weight, eps):
    return _norm(x, None, weight, eps)[0]


def _add_rms_norm(x, residual, weight, eps):
    if residual.shape != x.shape:
        raise ValueError(f"the residual {tuple(residual.shape)} does not match the rows {tuple(x.shape)}")
    return _norm(x, residual, weight, eps)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights float32 [T, K], ids int64 [T, K])`: each row's top-k experts by logit, best
    first (ties to the lower expert), weighted by their softmax probabilities, renormalised to
    sum to 1 if asked (the op `tandem::cpu_topk_softmax`)."""
    return _run(torch.ops.tandem.cpu_topk_softmax, _topk_softmax, router_logits, top_k, renormalize)


def _topk_softmax(router_logits, top_k, renormalize):
    logits = router_logits.contiguous()
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=torch.int64)
    _library().tandem_topk_softmax(logits.data_ptr(), _DTYPES[logits.dtype], tokens, experts, top_k, int(renormalize),
                                   weights.data_ptr(), ids.data_ptr())  # fmt: skip
    return weights, ids


def sample(logits: torch.Tensor, temperatures: list[float], uniforms: list[float]) -> torch.Tensor:
    """A token id per row of `logits [R, V]` (float32): drawn from the row's softmax at its
    temperature by inverse CDF at its uniform in [0, 1), or its first maximum where the
    temperature is 0 (see `tandem_sample`); `[R]` int64 (the op `tandem::cpu_sample`)."""
    return _run(torch.ops.tandem.cpu_sample, _sample, logits, temperatures, uniforms)


def _sample(logits, temperatures, uniforms):
    rows = logits.contiguous()
    count, vocab = rows.shape
    if len(temperatures) != count or len(uniforms) != count:
        raise ValueError(f"{count} rows of logits need as many temperatures and uniforms, "
                         f"got {len(temperatures)} and {len(uniforms)}")
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    uniform = torch.tensor(uniforms, dtype=torch.float64)
    out = torch.empty(count, dtype=torch.int64)
    status = _library().tandem_sample(rows.data_ptr(), count, vocab, vocab, temperature.data_ptr(),
                                      uniform.data_ptr(), out.data_ptr())  # fmt: skip
    if status:
        raise MemoryError("tandem_sample could not allocate its scratch")
    return out


# Registered through the dispatcher directly (as `tandem::cpu_linear` is): `custom_op`'s Python
# wrappers cost ~100 us a call, and a decode step calls these once per layer.
_LIBRARY = torch.library.Library("tandem", "FRAGMENT")
_LIBRARY.define("cpu_panel_linear(Tensor x, Tensor packed, int out_features) -> Tensor")
_LIBRARY.impl("cpu_panel_linear", _linear, "CPU")
_LIBRARY.define("cpu_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, int intermediate) -> Tensor")
_LIBRARY.impl("cpu_moe", _moe, "CPU")
_LIBRARY.define(
    "cpu_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
    "float scale) -> Tensor"
)
_LIBRARY.impl("cpu_decode_attention", _decode_attention, "CPU")
_LIBRARY.define(
    "cpu_rope_and_cache(Tensor positions, Tensor query, Tensor key, Tensor value, Tensor table, Tensor slot_mapping, "
    "Tensor(a!) key_cache, Tensor(b!) value_cache, bool interleaved) -> Tensor"
)
_LIBRARY.impl("cpu_rope_and_cache", _rope_and_cache, "CPU")
_LIBRARY.define("cpu_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIBRARY.impl("cpu_rms_norm", _rms_norm, "CPU")
_LIBRARY.define("cpu_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIBRARY.impl("cpu_add_rms_norm", _add_rms_norm, "CPU")
_LIBRARY.define("cpu_topk_softmax(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)")
_LIBRARY.impl("cpu_topk_softmax", _topk_softmax, "CPU")
_LIBRARY.define("cpu_sample(Tensor logits, float[] temperatures, float[] uniforms) -> Tensor")
_LIBRARY.impl("cpu_sample", _sample, "CPU")


@torch.library.register_fake("tandem::cpu_panel_linear", lib=_LIBRARY)
def _(x, packed, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("tandem::cpu_moe", lib=_LIBRARY)
def _(x, topk_ids, topk_weights, w13, w2, intermediate):
    return torch.empty_like(x)


@torch.library.register_fake("tandem::cpu_decode_attention", lib=_LIBRARY)
def _(query, key_cache, value_cache, block_table, seq_lens, scale):
    return query.new_empty((*query.shape[:2], value_cache.shape[-1]))


@torch.library.register_fake("tandem::cpu_rope_and_cache", lib=_LIBRARY)
def _(positions, query, key, value, table, slot_mapping, key_cache, value_cache, interleaved):
    return query.new_empty(query.shape)


@torch.library.register_fake("tandem::cpu_rms_norm", lib=_LIBRARY)
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("tandem::cpu_add_rms_norm", lib=_LIBRARY)
def _(x, residual, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("tandem::cpu_topk_softmax", lib=_LIBRARY)
def _(router_logits, top_k, renormalize):
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int64)


__all__ = [
    "add_rms_norm", "available", "cache_dir", "decode_attention", "linear", "moe", "pack", "rms_norm",
    "rope_and_cache", "sample", "switched_off", "takes", "takes_eager", "topk_softmax", "uses_amx",
]  # fmt: skip
