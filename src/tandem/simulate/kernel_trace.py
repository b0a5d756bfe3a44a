"""The MoE part of a layer's schedule, traced from the runtime: the real
`FusedMoEModularKernel.forward` runs on a recording stand-in (`_KernelTrace`) and the order it
takes its steps in, with a "yield" where its real `_hand_over` hands over under DBO and the
shared experts where the real `shared_experts_placement` puts them, is the order the simulator
plays (`schedule.layer_steps`).

In SBO combine-down-gemm the real `compute_experts` runs too: its block loop asks the stand-in
backend for the blocks (`finalize_in_blocks`), the stand-in experts yield them
(`apply_blocks`, recording each block's down projection as it is computed) and the kernel sends
each block's combine where it does; the order recorded is the kernel's own interleave.
The stand-in experts are the `torch` backend's kind (`Experts.blocks_down_projection`: the up
projection once for every row, "experts_up", then the down projection per block,
"experts_down_block"), the one the block-combining backends pair with in the MoE stack."""

from __future__ import annotations

import contextvars
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Callable, Iterator

from tandem.contexts.dbo import dbo_yield
from tandem.contexts.ubatch_context import _CURRENT_UBATCH
from tandem.modular_kernels.kernel import FusedMoEModularKernel
from tandem.modular_kernels.sbo import COMBINE_DOWN_GEMM

#: The kernel's step methods, as operation names.
KERNEL_STEPS = {
    "dispatch_send": "dispatch_send", "dispatch_recv": "dispatch_recv", "compute_experts": "experts",
    "combine_send": "combine_send", "combine_recv": "combine_recv", "compute_shared": "shared_experts",
    "output": "output",
}  # fmt: skip
#: combine-down-gemm's steps inside `compute_experts`: the experts' work before the blocks (the
#: up projection and activation), one block's down projection, one block's combine.
EXPERTS_UP, DOWN_BLOCK, COMBINE_BLOCK = "experts_up", "experts_down_block", "combine_block_send"


class _BlockCombine:
    """Stands in for the backend's `BlockCombine`: records each block's send; closing it
    (`finish`) issues nothing (the block-combining backends only hand back the receiver)."""

    def __init__(self, trace: "_KernelTrace", blocks: int):
        self.trace, self.blocks = trace, list(range(blocks))

    def send(self, index: int, output) -> None:
        self.trace._record(COMBINE_BLOCK)

    def finish(self):
        return None, lambda: None


class _BlockExperts:
    """Stands in for experts that block their down projection (`apply_blocks`): the up
    projection once, then each block's down projection as the kernel asks for the next block."""

    def __init__(self, trace: "_KernelTrace"):
        self.trace = trace

    def apply_blocks(self, tokens, w1, w2, blocks: list) -> Iterator[tuple[int, None]]:
        self.trace._record(EXPERTS_UP)
        for index, _ in enumerate(blocks):
            self.trace._record(DOWN_BLOCK)
            yield index, None


class _CommStream:
    """The kernel's comm stream as the trace sees it: ordering only, nothing to record."""

    def issue(self, device):
        return nullcontext()

    def joined(self, hook, device):
        return hook


class _KernelTrace:
    """Stands in for `FusedMoEModularKernel` while its real `forward` runs: records the steps.
    Its hand-overs are the real `_hand_over`'s (a yield is recorded by the ubatch it runs in)."""

    shared_experts_placement = FusedMoEModularKernel.shared_experts_placement

    _issue_combine = FusedMoEModularKernel._issue_combine

    def _hand_over(self, state, hook_field: str) -> None:
        FusedMoEModularKernel._hand_over(self, state, hook_field)

    def __init__(self, shared: bool, sbo_mode: str | None, yields_in_send: bool, blocks: int = 1):
        self.shared_experts = object() if shared else None
        self.prepare_finalize = SimpleNamespace(
            yields_in_send=yields_in_send, finalize_in_blocks=lambda *args, num_sms=None: _BlockCombine(self, blocks)
        )
        self.experts, self._comm_stream, self.comm_sms = _BlockExperts(self), _CommStream(), None
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
        return SimpleNamespace(
            sbo_mode=self.sbo_mode, dispatch_hook=None, combine_hook=None, tokens=None, hidden_states=SimpleNamespace(device=None),
            w1=None, w2=None, topk_weights=None, topk_ids=None, combine_sender=None, block_combine=None,
        )  # fmt: skip

    def dispatch_recv(self, state) -> None:
        self._record("dispatch_recv")
        state.tokens = "received"

    def compute_experts(self, state) -> None:
        """The experts: in combine-down-gemm the real method's block loop (the blocks and their
        combines in the kernel's order), else one step."""
        if state.sbo_mode == COMBINE_DOWN_GEMM:
            FusedMoEModularKernel.compute_experts(self, state)
        else:
            self._record("experts")

    def dispatch_send(self, state) -> None:
        self._send("dispatch_send")

    def combine_send(self, state) -> None:
        if state.block_combine is not None:  # its blocks left during the experts: the real method closes it
            FusedMoEModularKernel.combine_send(self, state)
        else:
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


def moe_forward_order(
    shared: bool, *, dbo: bool, sbo_mode: str | None = None, yields_in_send: bool = False, blocks: int = 1
) -> list[str]:
    """The MoE steps in the order the real `FusedMoEModularKernel.forward` runs them ("yield"
    where DBO hands over), inside a ubatch when `dbo`, with a backend that hands the host over
    inside its sends or not (`PrepareAndFinalize.yields_in_send`); in combine-down-gemm with
    `blocks` blocks (the backend's `finalize_in_blocks` decides how many: `block_combine.block_count`)."""
    trace = _KernelTrace(shared, sbo_mode, yields_in_send, blocks)

    def run() -> None:
        if dbo:
            _CURRENT_UBATCH.set(_InsideUBatch(trace))
        FusedMoEModularKernel.forward(trace, None, None, None, None, None)

    contextvars.copy_context().run(run)
    return trace.names


__all__ = ["COMBINE_BLOCK", "DOWN_BLOCK", "EXPERTS_UP", "KERNEL_STEPS", "moe_forward_order"]
