"""Kernels launched, counted without a GPU: every non-view ATen op dispatched while a scope is
open, through a `TorchDispatchMode`. On CUDA almost every such op is one kernel launch (a
view launches none, an allocation launches none), so the count is the proxy the issue's
"kernels per decoder layer" goal is measured by, on real tensors, on fake CUDA tensors
(`FakeTensorMode`) and on the CPU alike. Triton kernels are launched outside the dispatcher
and are not seen; whoever launches them adds their own count.

The dispatch-mode stack is per OS thread: ops run by another thread (the thread executor's
ubatch workers) are not counted; the greenlet executor runs on the caller's thread and is.
The open scopes are per context (`contextvars`), as each ubatch runs in its own: two
ubatches interleaving at their yields each keep their own nesting.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Ops that allocate, or only describe a tensor: no kernel on any device.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "set_"}


def launches_kernel(func) -> bool:
    """Whether an ATen op counts as a kernel: not a view (an alias of its input), not an
    allocation without data, not a `prim` metadata query (`prim::device` on fake tensors)."""
    if getattr(func, "is_view", False) or getattr(func, "namespace", "aten") == "prim":
        return False
    return func.overloadpacket.__name__ not in _NO_KERNEL


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching ATen ops: in total, per op name, and per open scope (a scope
    sees every op dispatched while it is open, nested scopes included: counts are inclusive)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self.by_scope: Counter[str] = Counter()
        self._open: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(f"op_scopes_{id(self)}", default=())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func):
            self.total += 1
            self.by_op[func.overloadpacket.__name__] += 1
            for scope in set(self._open.get()):  # a recursive scope (layers.*) counts an op once
                self.by_scope[scope] += 1
        return func(*args, **(kwargs or {}))

    def enter(self, scope: str) -> None:
        self._open.set(self._open.get() + (scope,))

    def leave(self, scope: str) -> None:
        open_scopes = self._open.get()
        if not open_scopes or open_scopes[-1] != scope:
            raise RuntimeError(f"op counter: leaving scope {scope!r} but the innermost open one is {open_scopes[-1:]}")
        self._open.set(open_scopes[:-1])

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)


@contextmanager
def module_scopes(counter: OpCounter, modules: Iterable[tuple[str, torch.nn.Module]]) -> Iterator[None]:
    """Opens scope `name` around every forward of each (name, module) while the block runs."""
    handles = []
    try:
        for name, module in modules:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: counter.enter(n)))
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: counter.leave(n), always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def count_ops_per_layer(model: torch.nn.Module, step) -> tuple[list[int], OpCounter]:
    """Runs `step()` once with every decoder layer of `model` (`model.model.layers`) as a
    scope; returns the kernel count of each layer, in layer order, and the counter."""
    layers = list(model.model.layers)
    counter = OpCounter()
    names = [f"layers.{i}" for i in range(len(layers))]
    with module_scopes(counter, zip(names, layers)), counter:
        step()
    return [counter.by_scope[n] for n in names], counter


__all__ = ["OpCounter", "count_ops_per_layer", "launches_kernel", "module_scopes"]
