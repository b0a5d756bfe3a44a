"""The MoE part of a layer's schedule, traced from the runtime: the real
`FusedMoEModularKernel.forward` runs on a recording stand-in (`_KernelTrace`) and the order it
takes its steps in, with a "yield" where its real `_hand_over` hands over under DBO and the
shared experts where the real `shared_experts_placement` puts them, is the order the simulator
plays (`schedule.layer_steps`)."""

from __future__ import annotations

import contextvars
from types import SimpleNamespace
from typing import Callable

from tandem.contexts.dbo import dbo_yield
from tandem.contexts.ubatch_context import _CURRENT_UBATCH
from tandem.modular_kernels.kernel import FusedMoEModularKernel

#: The kernel's step methods, as operation names.
KERNEL_STEPS = {
    "dispatch_send": "dispatch_send", "dispatch_recv": "dispatch_recv", "compute_experts": "experts",
    "combine_send": "combine_send", "combine_recv": "combine_recv", "compute_shared": "shared_experts",
    "output": "output",
}  # fmt: skip


class _KernelTrace:
    """Stands in for `FusedMoEModularKernel` while its real `forward` runs: records the steps.
    Its hand-overs are the real `_hand_over`'s (a yield is recorded by the ubatch it runs in)."""

    shared_experts_placement = FusedMoEModularKernel.shared_experts_placement

    def _hand_over(self, state, hook_field: str) -> None:
        FusedMoEModularKernel._hand_over(self, state, hook_field)

    def __init__(self, shared: bool, sbo_mode: str | None, yields_in_send: bool):
        self.shared_experts = object() if shared else None
        self.prepare_finalize = SimpleNamespace(yields_in_send=yields_in_send)
        self.sbo_mode, self.names, self._shared_done = sbo_mode, [], False

    def _record(self, name: str) -> None:
        self.names.append(name)

    def _send(self, name: str) -> None:
        """A send, as the backend issues it: one that `yields_in_send` captures its ubatch's
        compute, hands the host over, and issues the transfer when it resumes
        (`dbo_yield_and_switch_from_compute_to_comm`, a no-op outside a ubatch)."""
        if self.prepare_finalize.yields_in_send:
            dbo_yield()
        self._record(name)

    def dispatch_prepare(self, *args):
        return SimpleNamespace(sbo_mode=self.sbo_mode, dispatch_hook=None, combine_hook=None)

    def dispatch_send(self, state) -> None:
        self._send("dispatch_send")

    def combine_send(self, state) -> None:
        self._send("combine_send")

    def compute_shared(self, state) -> None:
        if self.shared_experts is not None and not self._shared_done:
            self._shared_done = True
            self._record("shared_experts")

    def output(self, state) -> None:
        self.compute_shared(state)
        self._record("output")

    def __getattr__(self, name: str) -> Callable:
        if name in KERNEL_STEPS:
            return lambda state: self._record(KERNEL_STEPS[name])
        raise AttributeError(name)


class _InsideUBatch:
    """The ubatch the trace runs in under DBO: a yield is recorded as a stage cut."""

    id = 0

    def __init__(self, trace: _KernelTrace):
        self.trace = trace

    def maybe_run_recv_hook(self) -> None:
        pass

    def yield_(self) -> None:
        self.trace._record("yield")


def moe_forward_order(shared: bool, *, dbo: bool, sbo_mode: str | None = None, yields_in_send: bool = False) -> list[str]:
    """The MoE steps in the order the real `FusedMoEModularKernel.forward` runs them ("yield"
    where DBO hands over), inside a ubatch when `dbo`, with a backend that hands the host over
    inside its sends or not (`PrepareAndFinalize.yields_in_send`)."""
    trace = _KernelTrace(shared, sbo_mode, yields_in_send)

    def run() -> None:
        if dbo:
            _CURRENT_UBATCH.set(_InsideUBatch(trace))
        FusedMoEModularKernel.forward(trace, None, None, None, None, None)

    contextvars.copy_context().run(run)
    return trace.names


__all__ = ["KERNEL_STEPS", "moe_forward_order"]
