"""The forward context: per-step metadata that model code reads without it being passed
through every call. Held in a `ContextVar`, so each ubatch (thread or greenlet) sees its own."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

_FORWARD_CONTEXT: ContextVar["ForwardContext | None"] = ContextVar("tandem_forward_context", default=None)


@dataclass
class ForwardContext:
    attn_metadata: Any = None
    #: `UBatchSlice`s when this step runs as ubatches, else None.
    ubatch_slices: list | None = None
    #: TBO only: every DP rank runs SGLang's decode strategy (True) or prefill strategy
    #: (False) this step; None lets a ubatch's own attention metadata decide.
    tbo_decode: bool | None = None
    #: The step's single-batch overlap choice for every MoE kernel; None leaves each kernel
    #: its own `enable_sbo`.
    sbo: bool | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def get_forward_context() -> ForwardContext | None:
    return _FORWARD_CONTEXT.get()


@contextlib.contextmanager
def set_forward_context(forward_context: ForwardContext | None) -> Iterator[ForwardContext | None]:
    token = _FORWARD_CONTEXT.set(forward_context)
    try:
        yield forward_context
    finally:
        _FORWARD_CONTEXT.reset(token)
