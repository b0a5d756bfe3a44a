"""Triton for the fused kernels: the lazy import, the interpreter switch, kernels defined
once per interpreter mode, and the rule that picks a Triton kernel over the torch path.

A fused op runs its Triton kernel on CUDA tensors and the plain torch path on CPU; tests
call the Triton entry points directly on CPU tensors under `TRITON_INTERPRET=1` (set
before triton is imported: `triton.jit` fixes the mode when a kernel is defined).
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable

import torch

TRITON_MISSING = (
    "this kernel needs the triton package, which is not installed; install it with: pip install 'tandem[gpu]'"
)


def import_triton():
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without triton
        raise ImportError(TRITON_MISSING) from exc
    return triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=None)
def triton_installed() -> bool:
    try:
        import_triton()
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a fused op on `tensor` takes its Triton kernel: on CUDA, with triton installed
    (on CPU the torch path is the fast one; the interpreter is for tests)."""
    return tensor.device.type == "cuda" and triton_installed()


@lru_cache(maxsize=None)
def _defined(define: Callable[[object], SimpleNamespace], interpret: bool) -> SimpleNamespace:
    del interpret  # only the cache key
    return define(import_triton())


def kernels(define: Callable[[object], SimpleNamespace]) -> SimpleNamespace:
    """`define(triton)`'s kernels, defined once per interpreter mode. Callers reach this as
    `triton_utils.kernels(...)` so a test harness can stand in for the launches."""
    return _defined(define, interpreting())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


__all__ = ["TRITON_MISSING", "import_triton", "interpreting", "kernels", "next_power_of_2", "triton_installed", "use_triton"]
