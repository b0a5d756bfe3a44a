"""What a CPU graph capture refuses, and why: every ATen op that reads tensor values on the
host (a sync a CUDA graph cannot hold) or whose output shape depends on them, the tensor
methods that read data without reaching the dispatcher, and non-functional collectives.
`CpuGraph` (cpu_graph.py) asks `refusal` about every op it records."""

from __future__ import annotations

from typing import Any

import torch

_SCALAR_READ = (
    "copies a tensor element to the host (.item(), int()/float()/bool() of a tensor, Python "
    "control flow on tensor values, or an op that validates its input on the host, e.g. F.one_hot on CPU)"
)
_DATA_SHAPE = "its output shape depends on tensor values, which a graph cannot hold"

#: ATen ops (by overload packet) refused during capture, and why.
HOST_SYNC_OPS: dict[str, str] = {
    "aten._local_scalar_dense": _SCALAR_READ,
    "aten.item": _SCALAR_READ,
    "aten.is_nonzero": "bool(tensor) reads the tensor's value on the host",
    "aten.equal": "torch.equal returns a host bool computed from tensor values",
    "aten.nonzero": _DATA_SHAPE + " (use masks / torch.where, or nonzero_static)",
    "aten.nonzero_numpy": _DATA_SHAPE,
    "aten.argwhere": _DATA_SHAPE,
    "aten.masked_select": _DATA_SHAPE + " (multiply by the mask instead)",
    "aten._unique": _DATA_SHAPE,
    "aten._unique2": _DATA_SHAPE,
    "aten.unique_dim": _DATA_SHAPE,
    "aten.unique_consecutive": _DATA_SHAPE,
    "aten.unique_dim_consecutive": _DATA_SHAPE,
    "aten.bincount": _DATA_SHAPE + " (its length is max(input) + 1)",
    "aten.to_sparse": _DATA_SHAPE + " (the number of non-zeros)",
    "aten._to_sparse": _DATA_SHAPE + " (the number of non-zeros)",
    "aten.to_sparse_csr": _DATA_SHAPE + " (the number of non-zeros)",
    "aten._to_sparse_csr": _DATA_SHAPE + " (the number of non-zeros)",
}

#: Tensor methods that read data without reaching the dispatcher, and why.
HOST_SYNC_METHODS: dict[str, str] = {
    "tolist": "copies the whole tensor to a host list",
    "numpy": "hands the tensor's memory to numpy on the host",
    "__array__": "hands the tensor's memory to numpy on the host",
    "__dlpack__": "exports the tensor's memory outside torch",
}

#: Ops that return a host number but only describe metadata (shapes, dtypes), not values.
_METADATA_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
        "dim", "numel", "is_contiguous", "is_complex", "is_floating_point", "is_signed", "is_conj", "is_neg",
        "is_inference", "is_pinned", "is_set_to", "_has_compatible_shallow_copy_type", "is_coalesced", "_nnz",
        "dense_dim", "sparse_dim", "result_type", "can_cast", "promote_types", "output_nr", "_version",
        "get_device", "retains_grad", "is_leaf", "_is_zerotensor",
    )
)
_HOST_VALUE_KINDS = frozenset(
    {"IntType", "BoolType", "FloatType", "NumberType", "ComplexType", "SymIntType", "SymFloatType", "SymBoolType"}
)
LIFT_OPS = ("lift_fresh", "lift_fresh_copy", "lift")


def op_name(func) -> str:
    return f"{func.namespace}.{func.name().split('::', 1)[-1].split('.', 1)[0]}"


_returns_cache: dict[Any, bool] = {}


def _returns_host_value(func) -> bool:
    cached = _returns_cache.get(func)
    if cached is None:
        cached = False
        for ret in func._schema.returns:
            kind = ret.type.kind()
            if kind in ("ListType", "OptionalType"):
                kind = ret.type.getElementType().kind()
            cached = cached or kind in _HOST_VALUE_KINDS
        _returns_cache[func] = cached
    return cached


def _has_bool_index(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ())
    )


def refusal(func, name: str, args: tuple, kwargs: dict) -> str | None:
    """Why `func(*args, **kwargs)` cannot be captured, or None."""
    reason = HOST_SYNC_OPS.get(name)
    if reason is not None:
        return reason
    if func.namespace == "c10d":
        return (
            "non-functional collectives complete through a Work.wait() that a graph cannot record; "
            "use torch.distributed._functional_collectives (all_to_all_single + wait_tensor, all_reduce, ...)"
        )
    if name == "aten.repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor):
        repeats_is_tensor = func._overloadname in ("Tensor", "self_Tensor")
        if repeats_is_tensor and kwargs.get("output_size", args[-1] if len(args) > 2 else None) is None:
            return _DATA_SHAPE + " (pass output_size=...)"
    if name == "aten.index" and _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
        return "indexing with a boolean mask: " + _DATA_SHAPE
    if name in ("aten.index_put", "aten.index_put_", "aten._index_put_impl_") and len(args) > 2:
        if _has_bool_index(args[1]) and isinstance(args[2], torch.Tensor) and args[2].numel() != 1:
            return "assigning several values through a boolean mask counts the mask on the host"
    if name not in _METADATA_OPS and _returns_host_value(func):
        return "it returns a host value computed from tensor data"
    return None
