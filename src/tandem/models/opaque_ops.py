"""Attention and the MoE layer as custom ops, opaque to `torch.compile`.

The compiled step (`tandem.models.compiled`) hands the decoder stack to inductor but keeps two
things out of its reach, as vLLM does: attention over the paged cache (`tandem::attention`:
rotary embedding, the cache write, attention; the projections around it are compiled) and a
MoE layer (`tandem::moe`: router, top-k, dispatch, experts, combine, shared experts). Inside
them run the forward-context reads (attention metadata, the step's SBO choice), host reads of
the step's lengths, the ubatch yields (`dbo_yield`), receive hooks and collectives, exactly as
in eager mode; the compiler sees one call with a known output shape and never traces them, so
DBO, SBO and PP behave the same with compilation on.

A layer is named by a string the op carries (`register_opaque`: its module path), unique in
the process: two models in one process never share a name. The table holds the modules weakly.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

_LAYERS: "weakref.WeakValueDictionary[str, nn.Module]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


def register_opaque(module: nn.Module, name: str) -> str:
    """Give `module` (an attention with `attend`, or a MoE block) the op name `name` (made
    unique in the process) and return it. The names are constants in the compiled graph, and
    so part of the compile cache's key: the same model built first in two processes gets the
    same names, and the second start reads the first one's cache."""
    current = getattr(module, "opaque_op_name", None)
    if current is not None:
        return current
    while name in _LAYERS:
        name = f"{name}#{next(_NEXT_ID)}"
    _LAYERS[name] = module
    module.opaque_op_name = name
    return name


def _layer(name: str) -> nn.Module:
    module = _LAYERS.get(name)
    if module is None:
        raise KeyError(f"no live layer registered as {name!r} for a tandem custom op (was its model freed?)")
    return module


# Registered through the dispatcher directly rather than with `torch.library.custom_op`, whose
# Python wrappers (autograd, device routing, a dynamo-disable frame) cost ~50-100 us a call,
# paid by every layer of every compiled step. The step runs under no_grad: no autograd kernel.
_LIBRARY = torch.library.Library("tandem", "FRAGMENT")
_LIBRARY.define("attention(Tensor[] prepared, str layer) -> Tensor")
_LIBRARY.define("moe(Tensor hidden, str layer) -> Tensor")


def attention(prepared: list[torch.Tensor], layer: str) -> torch.Tensor:
    """`layer.attend(prepared)`: `[T, heads * v_dim]` (the cache write happens inside)."""
    return _layer(layer).attend(tuple(prepared))


def moe(hidden: torch.Tensor, layer: str) -> torch.Tensor:
    """`layer.moe_forward(hidden)`: routed (and shared) experts, `[T, H]`."""
    return _layer(layer).moe_forward(hidden)


for _device in ("CPU", "CUDA"):
    _LIBRARY.impl("attention", attention, _device)
    _LIBRARY.impl("moe", moe, _device)


@torch.library.register_fake("tandem::attention", lib=_LIBRARY)
def _attention_fake(prepared: list[torch.Tensor], layer: str) -> torch.Tensor:
    query = prepared[1]
    return query.new_empty((query.shape[0], _layer(layer).attend_width))


@torch.library.register_fake("tandem::moe", lib=_LIBRARY)
def _moe_fake(hidden: torch.Tensor, layer: str) -> torch.Tensor:
    return torch.empty_like(hidden)


__all__ = ["attention", "moe", "register_opaque"]
