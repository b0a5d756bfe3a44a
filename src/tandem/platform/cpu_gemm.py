"""Weight GEMMs on CPU with each weight packed once for oneDNN.

`F.linear` on CPU hands the weight to MKL's sgemm, which repacks it on every call; with the
few rows of a decode step the repacking costs more than the product. On this project's 2-core
AVX2 machine, `[8, 1024] x [1024, 8192]` took 10.7 ms through `F.linear` and 4.0 ms with the
weight packed once (3.1 GB/s against 8.4 GB/s of weight read), and one expert's `[4, 1024] x
[1024, 1024]` 0.60 against 0.15 ms (`benchmarks/cpu_gemm.py`). vLLM's CPU backend packs its
weights for oneDNN the same way.

The packed copy is kept on the weight tensor itself, made at its first use and made again
when the weight changes (in place: its version counter moves), so a weight loaded after the
first step is never read stale (a weight made under `torch.inference_mode` has no version
counter: it is packed once). It costs a second copy of every packed weight in memory.

Anything oneDNN does not take here (another device or dtype, a weight that needs gradients,
bfloat16 on a CPU without AVX-512, no rows) runs the plain op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rows per call the packing is tuned for (a decode batch); any row count runs.
_PACKING_ROWS_HINT = 8
#: Smaller weights stay with `F.linear`: oneDNN's fixed cost per call outweighs the repacking
#: it saves (a 16 x 1024 router took 0.10 ms packed, 0.01 ms plain).
_MIN_PACKED_ELEMENTS = 1 << 16
_ATTRIBUTE = "_tandem_onednn_packed"


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_AVAILABLE = _onednn_available()


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # made under inference_mode: no version counter, read it as never changed
        return -1


def _packed(weight: torch.Tensor):
    """The oneDNN copy of `weight [N, K]`, current with its values, or None if it cannot be made."""
    version = _version(weight)
    cached = getattr(weight, _ATTRIBUTE, None)
    if cached is not None and cached[0] == version:
        return cached[1]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_ROWS_HINT)
    except RuntimeError:  # e.g. bfloat16 needs AVX-512 (or AVX-NE-CONVERT) in oneDNN
        packed = None
    setattr(weight, _ATTRIBUTE, (version, packed))
    return packed


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _AVAILABLE
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and weight.numel() >= _MIN_PACKED_ELEMENTS
        and x.numel() > 0
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        and type(weight) in (torch.Tensor, torch.nn.Parameter)  # not a fake or meta subclass
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight where oneDNN takes it."""
    packed = _packed(weight) if _packable(x, weight) else None
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """`x [sum(counts), K]` holds expert e's rows at the e-th run of `counts`; returns each run
    times `weights[e] [N, K]` transposed, one packed GEMM per expert with rows, or None when
    oneDNN does not take these operands (the caller then runs its grouped GEMM)."""
    if weights.dim() != 3 or not len(weights) or not _packable(x, weights[0]):
        return None
    per_expert = _packed_experts(weights)
    if per_expert is None:
        return None
    out = x.new_empty((x.shape[0], weights.shape[1]))
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = x[start : start + count]
            out[start : start + count] = torch.ops.mkldnn._linear_pointwise(rows, per_expert[expert], None, "none", [], "")
        start += count
    return out


def _packed_experts(weights: torch.Tensor):
    version = _version(weights)
    cached = getattr(weights, _ATTRIBUTE, None)
    if cached is not None and cached[0] == version:
        return cached[1]
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACKING_ROWS_HINT) for w in weights]
    except RuntimeError:
        packed = None
    setattr(weights, _ATTRIBUTE, (version, packed))
    return packed


__all__ = ["grouped_linear", "linear"]
