"""Kernels launched, counted without a GPU: every non-view ATen op dispatched while a scope is
open, through a `TorchDispatchMode`. On CUDA almost every such op is one kernel launch (a
view launches none, an allocation launches none), so the count is the proxy the issue's
"kernels per decoder layer" goal is measured by, on real tensors, on fake CUDA tensors
(`FakeTensorMode`) and on the CPU alike. Triton kernels are launched outside the dispatcher:
while the counter is entered it also listens at Triton's launcher
(`tandem.platform.triton_launches`) and counts those launches apart, by kernel name, in the
same scopes; `kernels(scope)` is the two together. ATen ops run inside a Triton launch (the
interpreter's copies to the host and back) belong to the launch and are not counted as ATen.

The dispatch-mode stack is per OS thread: ops run by another thread (the thread executor's
ubatch workers) are not counted, nor are Triton launches from another thread; the greenlet
executor runs on the caller's thread and is.
The open scopes are per context (`contextvars`), as each ubatch runs in its own: two
ubatches interleaving at their yields each keep their own nesting.
"""

from __future__ import annotations

import contextvars
import threading
from collections import Counter
from contextlib import ExitStack, contextmanager
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.platform import triton_launches

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
    sees every op dispatched while it is open, nested scopes included: counts are inclusive).
    Triton launches apart: `triton_total`, `triton_by_kernel`, `triton_by_scope` and, per
    scope, by kernel name (`triton_by_scope_kernel[scope]`)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self.by_scope: Counter[str] = Counter()
        self.triton_total = 0
        self.triton_by_kernel: Counter[str] = Counter()
        self.triton_by_scope: Counter[str] = Counter()
        self.triton_by_scope_kernel: dict[str, Counter[str]] = {}
        self._open: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(f"op_scopes_{id(self)}", default=())
        self._thread: int | None = None
        self._listening: list[ExitStack] = []

    def __enter__(self):
        stack = ExitStack()
        self._thread = threading.get_ident()
        stack.enter_context(triton_launches.listening(self._on_triton_launch))
        self._listening.append(stack)
        try:
            return super().__enter__()
        except BaseException:
            self._listening.pop().close()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._listening.pop().close()

    def _on_triton_launch(self, name: str) -> None:
        if threading.get_ident() != self._thread:
            return
        self.triton_total += 1
        self.triton_by_kernel[name] += 1
        for scope in set(self._open.get()):
            self.triton_by_scope[scope] += 1
            self.triton_by_scope_kernel.setdefault(scope, Counter())[name] += 1

    def kernels(self, scope: str | None = None) -> int:
        """ATen kernels and Triton launches together: in `scope`, or in the whole count."""
        if scope is None:
            return self.total + self.triton_total
        return self.by_scope[scope] + self.triton_by_scope[scope]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches_kernel(func) and not triton_launches.inside_launch():
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


def scope_kernels(counter: OpCounter | None, scope: str) -> dict:
    """A profile row's kernel fields: ATen kernels and Triton launches in `scope`, apart and
    together, and the Triton ones by kernel name (all None without a counter)."""
    if counter is None:
        return {"kernels": None, "aten_kernels": None, "triton_launches": None, "triton_by_kernel": None}
    return {
        "kernels": counter.kernels(scope), "aten_kernels": counter.by_scope[scope],
        "triton_launches": counter.triton_by_scope[scope],
        "triton_by_kernel": dict(counter.triton_by_scope_kernel.get(scope, {})),
    }


def step_kernels(counter: OpCounter | None, layers_scope: str, layers: int) -> dict:
    """A profile phase's kernel fields: per step and per decoder layer (`layers_scope` holds
    all `layers` of them), ATen and Triton apart and together; Triton per kernel name."""
    if counter is None:
        keys = ("kernels_per_step", "aten_kernels_per_step", "triton_launches_per_step", "kernels_per_decoder_layer",
                "aten_kernels_per_decoder_layer", "triton_launches_per_decoder_layer", "triton_by_kernel")
        return dict.fromkeys(keys)

    def per_layer(n: int) -> float | None:
        return n / layers if layers else None

    return {
        "kernels_per_step": counter.kernels(), "aten_kernels_per_step": counter.total,
        "triton_launches_per_step": counter.triton_total,
        "kernels_per_decoder_layer": per_layer(counter.kernels(layers_scope)),
        "aten_kernels_per_decoder_layer": per_layer(counter.by_scope[layers_scope]),
        "triton_launches_per_decoder_layer": per_layer(counter.triton_by_scope[layers_scope]),
        "triton_by_kernel": dict(counter.triton_by_kernel.most_common()),
    }


__all__ = ["OpCounter", "count_ops_per_layer", "launches_kernel", "module_scopes", "scope_kernels", "step_kernels"]
