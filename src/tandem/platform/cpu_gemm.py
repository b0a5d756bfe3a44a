"""Weight GEMMs on CPU with each weight packed once for oneDNN.

`F.linear` on CPU hands the weight to MKL's sgemm, which repacks it on every call; with the
few rows of a decode step the repacking costs more than the product. On this project's 2-core
AVX2 machine, `[8, 1024] x [1024, 8192]` took 10.7 ms through `F.linear` and 4.0 ms with the
weight packed once (3.1 GB/s against 8.4 GB/s of weight read), and one expert's `[4, 1024] x
[1024, 1024]` 0.60 against 0.15 ms (`benchmarks/cpu_gemm.py`). vLLM's CPU backend packs its
weights for oneDNN the same way.

Only module weights (`nn.Parameter`s) are packed, never a tensor made for one call. The
packed copy is kept in a side table keyed weakly by the parameter, made at its first use and
made again when the weight changes: in place (its version counter moves; loaders write through
`.detach()`, which shares it), or swapped, moved or cast (its storage, dtype or shape differ).
A weight made under `torch.inference_mode` has no version counter: it is packed once. Packing
runs outside any dispatch mode, so a `CpuGraph` capture (or an op count) sees only the GEMM
and its replays read the packed copy made at capture. It costs a second copy of every packed
weight in memory.

Anything oneDNN does not take here (another device or dtype, a weight that needs gradients,
bfloat16 on a CPU without AVX-512, a small weight, no rows, fake tensors) runs the plain op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakTensorKeyDictionary

from tandem.platform import cpu_kernels
from tandem.platform.graph import graph_capture_active

#: Rows per call the packing is tuned for (a decode batch); any row count runs.
_PACKING_ROWS_HINT = 8
#: Smaller weights stay with `F.linear`: oneDNN's fixed cost per call outweighs the repacking
#: it saves (a 16 x 1024 router took 0.10 ms packed, 0.01 ms plain).
_MIN_PACKED_ELEMENTS = 1 << 16


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_AVAILABLE = _onednn_available()
#: parameter -> {pack function: (its state when packed, the packed copy or copies, or None: refused)}.
_PACKED = WeakTensorKeyDictionary()
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _state(weight: torch.Tensor) -> tuple:
    # Made under inference_mode (as the loaders make weights): no version counter, read it as
    # never changed. Asked first: reading `_version` there raises, ~8 us a call.
    version = -1 if weight.is_inference() else weight._version
    return version, weight.data_ptr(), weight.dtype, weight.shape


def _cached(weight: torch.Tensor | tuple[torch.Tensor, ...], pack):
    """`pack(weight)` as of the weight's current state, made once per state and layout; for a
    tuple of weights, `pack` of them joined along the output dimension (kept with the first)."""
    weights = weight if isinstance(weight, tuple) else (weight,)
    state = tuple(_state(w) for w in weights)
    layouts = _PACKED.setdefault(weights[0], {})
    key = pack if len(weights) == 1 else (pack, len(weights))
    cached = layouts.get(key)
    if cached is not None and cached[0] == state:
        return cached[1]
    try:
        with _disable_current_modes(), torch.no_grad():
            packed = pack(weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights]))
    except RuntimeError:  # e.g. bfloat16 needs AVX-512 (or AVX-NE-CONVERT) in oneDNN
        packed = None
    layouts[key] = (state, packed)
    return packed


def _row_bucket(rows: int) -> int:
    """The row count a packed GEMM runs at: up to 16 as is, then a multiple of 16, above 256 a
    multiple of 64. oneDNN makes (JIT-compiles) a primitive per input shape, 1 ms at float32
    and 3-5 ms at bfloat16 on this machine, more than the GEMM; a prefill's per-expert row
    counts are new almost every call, bucketed they repeat (`benchmarks/cpu_gemm.py`)."""
    if rows <= 16:
        return rows
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def _packed_gemm(rows: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    count = rows.shape[0]
    bucket = _row_bucket(count)
    if bucket != count:
        padded = rows.new_zeros((bucket, rows.shape[1]))
        padded[:count] = rows
        rows = padded
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out if bucket == count else out[:count]


def _pack_one(weight: torch.Tensor):
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS_HINT)


def _pack_each_expert(weights: torch.Tensor):
    return [_pack_one(w) for w in weights]


def _module_gemm(x: torch.Tensor, weight: torch.Tensor, per_gemm: torch.Tensor) -> bool:
    """Whether `x` times a module weight may run on a packed copy: CPU operands of one dtype, no
    gradients. `per_gemm`: the part of `weight` one GEMM reads (one expert's, for stacked experts)."""
    return (
        type(weight) is torch.nn.Parameter
        and type(x) in _PLAIN_TYPES
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and per_gemm.dim() == 2
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    )


def _packable(x: torch.Tensor, weight: torch.Tensor, per_gemm: torch.Tensor) -> bool:
    """oneDNN takes it, and the weight is big enough to pay for oneDNN's fixed cost per call."""
    return _AVAILABLE and per_gemm.numel() >= _MIN_PACKED_ELEMENTS and _module_gemm(x, weight, per_gemm)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight where oneDNN takes it. Under
    `torch.compile` it is the opaque `tandem::cpu_linear` op on the CPU (inductor's own GEMM
    repacks the weight on every call at float32 with a dynamic row count), `F.linear` elsewhere."""
    if torch.compiler.is_compiling():
        if x.device.type == "cpu" and _AVAILABLE:
            return torch.ops.tandem.cpu_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if (
        _panel_kernel_takes(x, weight.numel())
        and _module_gemm(x, weight, weight)
        and cpu_kernels.takes(x, weight)
    ):  # any size: the kernel has no fixed cost to amortise (a router's 16 x 1024 took 0.18 ms in F.linear)
        out = cpu_kernels.linear(x, _cached(weight, cpu_kernels.pack), weight.shape[0])
        return out if bias is None else out + bias
    packed = _cached(weight, _pack_one) if _packable(x, weight, weight) else None
    if packed is None:
        return F.linear(x, weight, bias)
    out = _packed_gemm(x.reshape(-1, x.shape[-1]), packed, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def joined_linear(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, ...]:
    """`tuple(F.linear(x, w, b) for w, b in zip(weights, biases))`. Where `linear` would pack
    the weights, one GEMM over them joined (packed once, as one weight) whose outputs are views
    of its columns: q, k and v of an attention layer in one call instead of three, each with
    its fixed cost. Compiled on the CPU, the same GEMM as the opaque `tandem::cpu_joined_linear`;
    anywhere else (another device, a capture), one `linear` each."""
    widths = [w.shape[0] for w in weights]
    if torch.compiler.is_compiling():
        out = torch.ops.tandem.cpu_joined_linear(x, list(weights)) if x.device.type == "cpu" and _AVAILABLE else None
    else:
        out = _joined_gemm(x, weights)
    if out is None:
        return tuple(linear(x, w, b) for w, b in zip(weights, biases))
    parts = out.split(widths, dim=-1)
    return tuple(part if bias is None else part + bias for part, bias in zip(parts, biases))


def _joined_gemm(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """`x` times the weights joined, `[..., sum of their rows]`, in one packed GEMM; None where
    `linear` would not pack them."""
    if graph_capture_active() or not all(_module_gemm(x, w, w) for w in weights):
        return None
    width, elements = sum(w.shape[0] for w in weights), sum(w.numel() for w in weights)
    if _panel_kernel_takes(x, elements) and cpu_kernels.takes(x, *weights):
        return cpu_kernels.linear(x, _cached(weights, cpu_kernels.pack), width)
    if _AVAILABLE and elements >= _MIN_PACKED_ELEMENTS:
        packed = _cached(weights, _pack_one)
        if packed is not None:
            return _packed_gemm(x.reshape(-1, x.shape[-1]), packed, None).view(*x.shape[:-1], width)
    return None


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """`x [sum(counts), K]` holds expert e's rows at the e-th run of `counts`; returns each run
    times `weights[e] [N, K]` transposed, one packed GEMM per expert with rows, or None when
    oneDNN does not take these operands (the caller then runs its grouped GEMM)."""
    if weights.dim() != 3 or not len(weights) or not _packable(x, weights, weights[0]):
        return None
    per_expert = _cached(weights, _pack_each_expert)
    if per_expert is None:
        return None
    out = x.new_empty((x.shape[0], weights.shape[1]))
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = x[start : start + count]
            out[start : start + count] = _packed_gemm(rows, per_expert[expert], None)
        start += count
    return out


#: Weights up to this many elements are "small" for float32 (2 MB: a tiny model's projections).
_SMALL_WEIGHT = 1 << 19


def _panel_kernel_takes(x: torch.Tensor, weight_elements: int) -> bool:
    """Whether a dense GEMM runs tandem's panel kernel rather than oneDNN, by its rows and its
    weight's size (`benchmarks/cpu_gemm.py`, 2 threads): bfloat16 on AMX tiles stays
    memory-bound to 32 rows (1.0-1.4x oneDNN's time there); float32 in registers wins at one
    row (1.1x), where oneDNN's fixed cost per call weighs most, and up to 32 rows of a small
    weight (0.54-0.86x oneDNN's time for 256 x 256 to 2048 x 256), but not of a large one
    (1.03-1.15x at 8-32 rows of 1024 x 1024 and up)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= 1:
        return True
    if rows > 32:
        return False
    if x.dtype == torch.bfloat16 and cpu_kernels.uses_amx():
        return True
    return x.dtype == torch.float32 and weight_elements <= _SMALL_WEIGHT


def fused_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor | None:
    """The routed experts of `x [T, K]` in one call of tandem's CPU kernel (`cpu_kernels.moe`):
    `w1 [E, 2I, K]` (gate rows, then up), `w2 [E, K, I]`, weights packed once. At every row
    count, decode to a 4,096-token prefill, it beat oneDNN's GEMM per expert with the torch ops
    between them (1.2-2.1x a layer, hidden 1024, 2 threads). None where the kernel does not
    take the operands, or under a graph capture (a `CpuGraph` records ATen ops only)."""
    if not (
        w1.dim() == 3
        and type(w1) is torch.nn.Parameter
        and type(w2) is torch.nn.Parameter
        and cpu_kernels.takes(x, w1, w2)
        and not (torch.is_grad_enabled() and (w1.requires_grad or w2.requires_grad or x.requires_grad))
    ):
        return None
    return cpu_kernels.moe(x, topk_ids, topk_weights, _cached(w1, cpu_kernels.pack), _cached(w2, cpu_kernels.pack), w2.shape[2])


__all__ = ["fused_experts", "grouped_linear", "joined_linear", "linear"]


# `tandem::cpu_linear`, registered through the dispatcher directly rather than with
# `torch.library.custom_op`, whose Python wrappers (autograd, device routing, a dynamo-disable
# frame) cost ~100 us a call: a compiled decode step calls it for every projection.
_LIBRARY = torch.library.Library("tandem", "FRAGMENT")
_LIBRARY.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("cpu_linear", linear, "CPU")


@torch.library.register_fake("tandem::cpu_linear", lib=_LIBRARY)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _joined_linear_op(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    out = _joined_gemm(x, tuple(weights))
    return torch.cat([linear(x, w) for w in weights], dim=-1) if out is None else out


# `tandem::cpu_joined_linear`: the compiled step's q/k/v in one GEMM, as in eager.
_LIBRARY.define("cpu_joined_linear(Tensor x, Tensor[] weights) -> Tensor")
_LIBRARY.impl("cpu_joined_linear", _joined_linear_op, "CPU")


@torch.library.register_fake("tandem::cpu_joined_linear", lib=_LIBRARY)
def _(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))
