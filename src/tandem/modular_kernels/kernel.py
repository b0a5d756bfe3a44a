"""`FusedMoEModularKernel`: prepare (dispatch) → experts → finalize (combine) as SGLang's
steps, with the DBO yield points where vLLM puts them and single-batch overlap (SBO) in
SGLang's three modes (`tandem.modular_kernels.sbo`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tandem.contexts import (
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    get_forward_context,
)
from tandem.modular_kernels.interfaces import (
    BlockCombine, CombineSend, DispatchSend, Experts, ExpertTokens, PrepareAndFinalize, RecvHook,
)  # fmt: skip
from tandem.modular_kernels.sbo import (
    COMBINE_DOWN_GEMM,
    COMBINE_SHARED,
    DISPATCH_SHARED,
    CommStream,
    check_block_combine,
    check_sbo_mode,
    resolve_sbo_mode,
)
from tandem.modular_kernels.sm_partition import comm_sm_partition


@dataclass(eq=False)
class MoEStepState:
    """One MoE layer call of one batch or ubatch between its steps: the inputs, then what
    each step leaves for the next. A TBO stage keeps it in its per-ubatch state."""

    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    #: the SBO mode this call runs (None: SBO off), fixed when the dispatch is prepared.
    sbo_mode: str | None = None
    #: dispatch prepared, not sent yet: the send (`PrepareAndFinalize.prepare_before_send`).
    dispatch_sender: DispatchSend | None = None
    #: dispatch in flight: the receive hook (None once run or handed to another ubatch)
    #: and the receiver that waits and returns the tokens.
    dispatch_hook: RecvHook | None = None
    dispatch_receiver: Callable[[], ExpertTokens] | None = None
    tokens: ExpertTokens | None = None
    expert_out: torch.Tensor | None = None
    #: combine prepared right after the experts, not sent yet (`finalize_before_send`).
    combine_sender: CombineSend | None = None
    #: combine-down-gemm: the combine already sent block by block, and the blocks'
    #: outputs (kept alive until the combine has read them on its stream).
    block_combine: BlockCombine | None = None
    expert_blocks: list[torch.Tensor] | None = None
    combine_hook: RecvHook | None = None
    combine_receiver: Callable[[], torch.Tensor] | None = None
    #: `[T, H]` weighted sum over the routed experts (plus the shared output where folded).
    routed_output: torch.Tensor | None = None
    shared_output: torch.Tensor | None = None
    #: True when nothing overlaps the shared experts (`forward`, no window for them): the
    #: experts' step may run them first and add their output (`_may_fold_shared`).
    shared_free: bool = False
    #: True when the experts added `shared_output` in their last reduction (`_shared_ready`).
    shared_folded: bool = False


class FusedMoEModularKernel:
    """Routed experts (plus optional shared experts) of one MoE layer on one EP rank.

    Under DBO each transfer is split around a yield: the sending ubatch registers the
    receive hook on the next ubatch and yields; that ubatch issues the receive after it
    has queued its own work, and the sender picks up the result when its turn returns.
    Without DBO the receive happens in place, unless `enable_sbo` overlaps work with a
    transfer in flight, in `sbo_mode` (see `tandem.modular_kernels.sbo`); `comm_sms` SMs
    go to the combine and the rest to the GEMMs while the down projection overlaps it.
    """

    def __init__(
        self,
        prepare_finalize: PrepareAndFinalize,
        experts: Experts,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        use_fp8_dispatch: bool = False,
        enable_sbo: bool = False,
        sbo_mode: str = "auto",
        comm_sms: int | None = None,
    ):
        if prepare_finalize.activation_format != experts.activation_format:
            raise ValueError(
                f"{prepare_finalize.name!r} dispatch produces {prepare_finalize.activation_format.value} "
                f"activations but {experts.name!r} experts ({type(experts).__name__}) take "
                f"{experts.activation_format.value} ones; pick a pair of the same format"
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.shared_experts = shared_experts
        self.use_fp8_dispatch = use_fp8_dispatch
        self.enable_sbo = enable_sbo
        self.sbo_mode = sbo_mode
        self.comm_sms = comm_sms
        self._comm_stream = CommStream()

    @property
    def sbo_mode(self) -> str:
        return self._sbo_mode

    @sbo_mode.setter
    def sbo_mode(self, mode: str) -> None:
        check_block_combine(check_sbo_mode(mode), self.prepare_finalize)
        self._sbo_mode = mode

    def __repr__(self) -> str:
        sbo = self.sbo_mode if self.enable_sbo else "off"
        return (
            f"FusedMoEModularKernel({self.prepare_finalize.name}+{self.experts.name}, "
            f"format={self.experts.activation_format.value}, fp8={self.use_fp8_dispatch}, sbo={sbo})"
        )

    def active_sbo_mode(self, device: torch.device) -> str | None:
        """The SBO mode a call on `device` runs: None when SBO is off (the step's choice in
        the forward context, else `enable_sbo`), or when the backend's transfers complete
        before they return (nothing to overlap) outside DBO."""
        if not self.sbo_enabled() or not (self.prepare_finalize.supports_async() or dbo_enabled()):
            return None
        return resolve_sbo_mode(self.sbo_mode, self.prepare_finalize, self.experts, device)

    def sbo_enabled(self) -> bool:
        step = get_forward_context()
        return self.enable_sbo if step is None or step.sbo is None else step.sbo

    def shared_experts_placement(self, sbo_mode: str | None) -> str | None:
        """Where `forward` runs the shared experts: "dispatch" (between the dispatch send
        and its receive), "combine" (between the combine send and its receive) or None (at
        the output; before the experts where they add its output, `compute_experts`). Under
        DBO without SBO they go in the combine window, as in vLLM."""
        if self.shared_experts is None:
            return None
        if sbo_mode in (DISPATCH_SHARED, COMBINE_DOWN_GEMM):
            return "dispatch"
        if sbo_mode == COMBINE_SHARED or dbo_enabled():
            return "combine"
        return None

    def _check(self, hidden, w1, w2, topk_weights, topk_ids) -> None:
        local = self.prepare_finalize.num_local_experts
        if hidden.dim() != 2:
            raise ValueError(f"hidden_states must be [tokens, hidden], got shape {tuple(hidden.shape)}")
        num_tokens, hidden_size = hidden.shape
        if w1.dim() != 3 or w1.shape[0] != local or w1.shape[2] != hidden_size or w1.shape[1] % 2:
            raise ValueError(
                f"w1 must be [E_local={local}, 2*I, H={hidden_size}], got shape {tuple(w1.shape)}"
            )
        if tuple(w2.shape) != (local, hidden_size, w1.shape[1] // 2):
            raise ValueError(
                f"w2 must be [E_local={local}, H={hidden_size}, I={w1.shape[1] // 2}], got shape {tuple(w2.shape)}"
            )
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
            raise ValueError(
                f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                f"must both be [tokens={num_tokens}, top_k]"
            )

    # -- the steps (SGLang's names); `forward` and the TBO operation lists both run these --

    def dispatch_prepare(self, hidden_states, w1, w2, topk_weights, topk_ids) -> MoEStepState:
        """Validate the inputs and run the backend's part of the dispatch before its send
        (`prepare_before_send`: DeepEP's normal kernels cast and record this ubatch's compute;
        the others nothing); never blocks the host, never yields."""
        self._check(hidden_states, w1, w2, topk_weights, topk_ids)
        state = MoEStepState(
            hidden_states, w1, w2, topk_weights, topk_ids, sbo_mode=self.active_sbo_mode(hidden_states.device)
        )
        ue8m0 = (
            self.use_fp8_dispatch
            and self.prepare_finalize.dispatches_ue8m0
            and self.experts.takes_ue8m0_scales(hidden_states.device)
        )
        state.dispatch_sender = self.prepare_finalize.prepare_before_send(
            hidden_states, topk_weights, topk_ids, use_fp8=self.use_fp8_dispatch, ue8m0=ue8m0
        )
        return state

    def dispatch_send(self, state: MoEStepState) -> None:
        """Issue the prepared dispatch (where the backend `yields_in_send`, the host may wait
        here, and under DBO the backend yields first). The receive hook (if the backend has
        one) stays in the state for `dispatch_recv`."""
        send = _take(state, "dispatch_sender", "dispatch_prepare", verb="send", done="sent")
        state.dispatch_hook, state.dispatch_receiver = send()

    def dispatch_recv(self, state: MoEStepState) -> None:
        """Run the receive hook unless it was handed to another ubatch, wait, keep the tokens."""
        _run_hook(state, "dispatch_hook")
        state.tokens = _take(state, "dispatch_receiver", "dispatch_send")()

    def compute_experts(self, state: MoEStepState) -> None:
        """The expert GEMMs; they add the shared output where it is ready (run first here
        when nothing overlaps it). In combine-down-gemm, block by block: each block's combine
        is issued on the comm stream as soon as its down projection is done."""
        if state.tokens is None:
            raise RuntimeError("compute_experts needs the dispatched tokens: call dispatch_recv first")
        if state.sbo_mode != COMBINE_DOWN_GEMM:
            may_fold = _may_fold_shared(self, state.hidden_states.device)
            if may_fold and state.shared_free:
                self.compute_shared(state)
            shared = _shared_ready(state) if may_fold else None
            folded = {} if shared is None else {"shared": shared}
            state.expert_out = self.experts.apply(state.tokens, state.w1, state.w2, **folded)
            state.shared_folded = shared is not None
            state.combine_sender = self.prepare_finalize.finalize_before_send(
                state.expert_out, state.tokens, state.topk_weights, state.topk_ids
            )
            return
        device = state.hidden_states.device
        combine = self.prepare_finalize.finalize_in_blocks(
            state.tokens, state.topk_weights, state.topk_ids, num_sms=self.comm_sms
        )
        state.expert_blocks = []
        with comm_sm_partition(self.comm_sms):
            for index, block_out in self.experts.apply_blocks(state.tokens, state.w1, state.w2, combine.blocks):
                state.expert_blocks.append(block_out)
                with self._comm_stream.issue(device):
                    combine.send(index, block_out)
        state.block_combine = combine

    def combine_send(self, state: MoEStepState) -> None:
        """Issue the combine: in combine-shared on the comm stream; in combine-down-gemm
        its blocks are out already and this closes it."""
        if state.block_combine is None and state.combine_sender is None:
            raise RuntimeError("combine_send needs the expert output: call compute_experts first (once per send)")
        if state.sbo_mode not in (COMBINE_SHARED, COMBINE_DOWN_GEMM):
            state.combine_hook, state.combine_receiver = self._issue_combine(state)
            return
        device = state.hidden_states.device
        with self._comm_stream.issue(device):
            hook, state.combine_receiver = self._issue_combine(state)
        state.combine_hook = self._comm_stream.joined(hook, device)

    def _issue_combine(self, state: MoEStepState):
        if state.block_combine is not None:
            combine, state.block_combine = state.block_combine, None
            return combine.finish()
        return _take(state, "combine_sender", "compute_experts", verb="send", done="sent")()

    def combine_recv(self, state: MoEStepState) -> None:
        """Run the receive hook unless it was handed to another ubatch, wait, keep the
        routed output `[T, H]`."""
        # The hook first: its receive goes on the stream the send was issued on (the comm
        # stream in the combine modes), so the join must come after it.
        _run_hook(state, "combine_hook")
        if state.sbo_mode in (COMBINE_SHARED, COMBINE_DOWN_GEMM):
            self._comm_stream.join(state.hidden_states.device)
        state.routed_output = _take(state, "combine_receiver", "combine_send")()
        state.expert_blocks = None

    def compute_shared(self, state: MoEStepState) -> None:
        """The shared experts on this ubatch's tokens; once, wherever the schedule puts it."""
        if self.shared_experts is not None and state.shared_output is None:
            state.shared_output = self.shared_experts(state.hidden_states)

    def output(self, state: MoEStepState) -> torch.Tensor:
        """Routed plus shared output (the shared experts run now if no step ran them yet)."""
        if state.routed_output is None:
            raise RuntimeError("output needs the routed output: call combine_recv first")
        self.compute_shared(state)
        if state.shared_output is None or state.shared_folded:
            return state.routed_output
        return state.routed_output + state.shared_output

    # -- DBO: the steps with the yield / receive-hook handover between them ---------------

    def _hand_over(self, state: MoEStepState, hook_field: str) -> None:
        """Under DBO, park this transfer's receive hook on the next ubatch and yield (a
        synchronous backend yields too, so every ubatch keeps the same schedule, unless its
        send already yielded); outside DBO the receive step runs the hook in place."""
        if not dbo_enabled():
            return
        hook = getattr(state, hook_field)
        if hook is not None:
            setattr(state, hook_field, None)
            dbo_register_recv_hook(hook)
            dbo_yield()
        elif not self.prepare_finalize.yields_in_send:
            dbo_yield()

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids) -> torch.Tensor:
        """The whole layer (inputs as `dispatch_prepare`): the steps in order, with the DBO
        handover at each transfer and the shared experts where the SBO mode puts them."""
        dbo_maybe_run_recv_hook()
        state = self.dispatch_prepare(hidden_states, w1, w2, topk_weights, topk_ids)
        self.dispatch_send(state)
        shared_at = self.shared_experts_placement(state.sbo_mode)
        state.shared_free = shared_at is None
        if shared_at == "dispatch":
            self.compute_shared(state)
        self._hand_over(state, "dispatch_hook")
        self.dispatch_recv(state)

        self.compute_experts(state)

        dbo_maybe_run_recv_hook()
        self.combine_send(state)
        if shared_at == "combine":
            self.compute_shared(state)
        self._hand_over(state, "combine_hook")
        self.combine_recv(state)
        return self.output(state)

    __call__ = forward


def _may_fold_shared(kernel: FusedMoEModularKernel, device: torch.device) -> bool:
    """Whether the experts can add the shared experts' output in their last reduction
    (gpu-review-3 G8): the combine hands their output back as it is (`local`) and they can
    (the Triton pair sum, on CUDA or the interpreter)."""
    return (
        kernel.shared_experts is not None
        and kernel.prepare_finalize.combine_is_identity
        and kernel.experts.adds_shared_output(device)
    )


def _shared_ready(state: MoEStepState) -> torch.Tensor | None:
    """Where the experts may add it (`_may_fold_shared`, asked once by the caller): the shared
    output, if it is ready when they run (the shared experts ran before: `forward` with nothing
    to overlap them or in the dispatch window, TBO's decode order) and has the routed output's
    dtype and shape; else None: `output` adds it."""
    shared, tokens = state.shared_output, state.tokens
    if shared is None or shared.dtype != tokens.dtype or shared.shape != state.hidden_states.shape:
        return None
    return shared


def _run_hook(state: MoEStepState, field: str) -> None:
    hook = getattr(state, field)
    if hook is not None:
        setattr(state, field, None)
        hook()


def _take(state: MoEStepState, field: str, before: str, *, verb: str = "receive", done: str = "received"):
    """The step's half of a transfer left in `state.field` by `before`, cleared: each transfer
    is sent once and received once."""
    half = getattr(state, field)
    if half is None:
        raise RuntimeError(f"nothing to {verb}: call {before} first (each transfer is {done} once)")
    setattr(state, field, None)
    return half
