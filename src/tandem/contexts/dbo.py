"""The `dbo_*` functions that model and kernel code call at its overlap points.

Each acts on the calling ubatch's context and is a no-op outside a ubatch, so the same
model code runs with and without DBO.
"""

from __future__ import annotations

from typing import Any, Callable

from tandem.contexts.ubatch_context import _CURRENT_UBATCH, current_stage_ubatch


def dbo_enabled() -> bool:
    return _CURRENT_UBATCH.get() is not None


def dbo_current_ubatch_id() -> int:
    """The running ubatch's id, under any executor (threads, greenlets, stages); 0 outside
    one, so per-ubatch buffers can be indexed the same way with DBO off."""
    ctx = _CURRENT_UBATCH.get()
    if ctx is not None:
        return ctx.id
    return current_stage_ubatch() or 0


_current_ubatch = _CURRENT_UBATCH.get  # bound once: `dbo_yield` is on every MoE layer's path


def dbo_yield() -> None:
    ctx = _current_ubatch()
    if ctx is not None:
        ctx.yield_()


def dbo_register_recv_hook(hook: Callable[[], Any]) -> None:
    """Park `hook` (the receive half of an async collective) on the next ubatch, which runs
    it at its own `dbo_maybe_run_recv_hook()` or when it exits; outside a ubatch nothing
    happens and the caller receives in place."""
    ctx = _CURRENT_UBATCH.get()
    if ctx is not None:
        ctx.register_recv_hook(hook)


def dbo_maybe_run_recv_hook() -> None:
    ctx = _CURRENT_UBATCH.get()
    if ctx is not None:
        ctx.maybe_run_recv_hook()


def _delegate(method: str, doc: str) -> Callable[[], None]:
    def call() -> None:
        ctx = _CURRENT_UBATCH.get()
        if ctx is not None:
            getattr(ctx, method)()

    call.__name__ = call.__qualname__ = f"dbo_{method}"
    call.__doc__ = doc
    return call


dbo_switch_to_comm = _delegate("switch_to_comm", "Make the comm stream current.")
dbo_switch_to_compute = _delegate("switch_to_compute", "Make the compute stream current.")
dbo_switch_to_comm_sync = _delegate(
    "switch_to_comm_sync", "Move to the comm stream after the compute queued so far."
)
dbo_switch_to_compute_sync = _delegate(
    "switch_to_compute_sync", "Move to the compute stream after the communication queued so far."
)
dbo_yield_and_switch_from_compute_to_comm = _delegate(
    "yield_and_switch_from_compute_to_comm",
    "Hand the CPU to the next ubatch, then continue on the comm stream behind this ubatch's compute.",
)
dbo_yield_and_switch_from_comm_to_compute = _delegate(
    "yield_and_switch_from_comm_to_compute",
    "Hand the CPU to the next ubatch, then continue on the compute stream behind this ubatch's communication.",
)
