"""Single-batch overlap (SBO): SGLang's three modes (`SboFlags`), which one `auto` picks,
and the second stream the combine runs on.

- `combine-down-gemm`: the down projection runs block by block (one local expert, or one
  chunk of rows, at a time) and each finished block's combine leaves at once, so the
  combine travels while the last blocks compute. The shared experts run in the dispatch
  window, as SGLang pairs the two on Hopper.
- `combine-shared`: the combine is issued on the comm stream and the shared experts run on
  the compute stream while it is in flight.
- `dispatch-shared`: the shared experts run on the compute stream between the dispatch send
  and its receive (before the receive hook is run, or handed to the next ubatch).

`auto` follows SGLang: down-GEMM overlap where the experts block their down projection and
the combine can leave per block; otherwise dispatch-shared, except on Blackwell
(compute capability 10), where SGLang overlaps the shared experts with the combine.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tandem.contexts import current_ubatch_context
from tandem.modular_kernels.interfaces import Experts, PrepareAndFinalize
from tandem.platform import get_platform

SBO_MODES = ("auto", "combine-down-gemm", "combine-shared", "dispatch-shared")
COMBINE_DOWN_GEMM, COMBINE_SHARED, DISPATCH_SHARED = SBO_MODES[1:]


def check_sbo_mode(mode: str) -> str:
    if mode not in SBO_MODES:
        raise ValueError(f"sbo_mode must be one of {', '.join(SBO_MODES)}, got {mode!r}")
    return mode


def check_block_combine(mode: str, prepare_finalize: PrepareAndFinalize) -> None:
    if mode == COMBINE_DOWN_GEMM and not prepare_finalize.supports_block_combine():
        raise ValueError(
            f"sbo_mode {COMBINE_DOWN_GEMM!r} sends the combine per block, which the {prepare_finalize.name!r} "
            "all2all backend cannot do; pick torch_a2a or torch_a2a_ll, or another sbo_mode"
        )


def _is_blackwell(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def resolve_sbo_mode(mode: str, prepare_finalize: PrepareAndFinalize, experts: Experts, device: torch.device) -> str:
    """The concrete mode `mode` means for these backends on `device`."""
    if mode != "auto":
        return mode
    if prepare_finalize.supports_block_combine() and experts.blocks_down_projection:
        return COMBINE_DOWN_GEMM
    return COMBINE_SHARED if _is_blackwell(device) else DISPATCH_SHARED


class CommStream:
    """The stream a combine is issued on while compute goes on: the ubatch's comm stream
    under DBO, else one of this kernel's own per device type. On CPU streams are ordering
    tokens and this costs a few Python calls."""

    def __init__(self) -> None:
        self._own: dict[str, object] = {}

    def _streams(self, device: torch.device):
        platform = get_platform(device.type)
        ctx = current_ubatch_context()
        if ctx is not None:
            comm = ctx.comm_stream
        else:
            if device.type not in self._own:
                self._own[device.type] = platform.new_stream()
            comm = self._own[device.type]
        return platform, platform.current_stream(), comm

    @staticmethod
    def _order(platform, before, after) -> None:
        event = platform.new_event()
        event.record(before)
        event.wait(after)

    @contextmanager
    def issue(self, device: torch.device) -> Iterator[None]:
        """Run the block on the comm stream once the compute queued so far is done (the
        per-block "ready" signal), then return to the compute stream without waiting."""
        platform, compute, comm = self._streams(device)
        self._order(platform, compute, comm)
        platform.set_stream(comm)
        try:
            yield
        finally:
            platform.set_stream(compute)

    def joined(self, hook, device: torch.device):
        """`hook` (a receive hook, run by whichever ubatch receives) followed by the join of
        the comm stream; None stays None. The hook goes first: DeepEP launches the receive
        on the stream current at *send* time (here the comm stream), so only a join after
        the hook orders that receive before the compute stream reads its output (and joins
        it into a graph capture)."""
        if hook is None:
            return None

        def run() -> None:
            hook()
            self.join(device)

        return run

    def join(self, device: torch.device) -> None:
        """Before the receive on the compute stream: wait for what the comm stream issued.
        (The other direction needs no event: every `issue` starts behind all compute queued
        so far, so comm-stream work never overtakes a receive that reads its buffers, and
        a graph capture sees each fork joined.)"""
        platform, compute, comm = self._streams(device)
        self._order(platform, comm, compute)
