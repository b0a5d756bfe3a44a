"""`FusedMoEModularKernel`: prepare (dispatch) → experts → finalize (combine), with the DBO
yield points where vLLM puts them and single-batch overlap (SBO) of the shared experts."""

from __future__ import annotations

from typing import Callable

import torch

from tandem.contexts import dbo_enabled, dbo_maybe_run_recv_hook, dbo_register_recv_hook, dbo_yield
from tandem.modular_kernels.interfaces import Experts, PrepareAndFinalize, RecvHook


class FusedMoEModularKernel:
    """Routed experts (plus optional shared experts) of one MoE layer on one EP rank.

    Under DBO each transfer is split around a yield: the sending ubatch registers the
    receive hook on the next ubatch and yields; that ubatch issues the receive after it
    has queued its own work, and the sender picks up the result when its turn returns.
    Without DBO the receive happens in place, unless `enable_sbo` asks to overlap the
    shared experts with a transfer in flight.

    `shared_experts_overlap` picks that transfer: `"combine"` (vLLM's placement, between
    the combine send and the yield) or `"dispatch"` (SGLang TBO's, between the dispatch
    send and the yield), whichever balances the model's compute around its transfers.
    """

    def __init__(
        self,
        prepare_finalize: PrepareAndFinalize,
        experts: Experts,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        use_fp8_dispatch: bool = False,
        enable_sbo: bool = False,
        shared_experts_overlap: str = "combine",
    ):
        if shared_experts_overlap not in ("combine", "dispatch"):
            raise ValueError(f"shared_experts_overlap must be 'combine' or 'dispatch', got {shared_experts_overlap!r}")
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
        self.shared_experts_overlap = shared_experts_overlap

    def __repr__(self) -> str:
        return (
            f"FusedMoEModularKernel({self.prepare_finalize.name}+{self.experts.name}, "
            f"format={self.experts.activation_format.value}, fp8={self.use_fp8_dispatch}, sbo={self.enable_sbo})"
        )

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

    @staticmethod
    def _receive(hook: RecvHook | None, overlap: Callable[[], None] | None = None) -> None:
        """Complete a transfer: hand it to the next ubatch under DBO, else wait in place,
        running `overlap` (work that does not depend on the transfer) in between."""
        if overlap is not None:
            overlap()
        if dbo_enabled():
            if hook is not None:
                dbo_register_recv_hook(hook)
            # A synchronous backend still yields so every ubatch keeps the same schedule.
            dbo_yield()
        elif hook is not None:
            hook()

    def forward(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        self._check(hidden_states, w1, w2, topk_weights, topk_ids)
        pf = self.prepare_finalize
        overlap_shared = self.shared_experts is not None and (
            dbo_enabled() or (self.enable_sbo and pf.supports_async())
        )
        shared_out: list[torch.Tensor] = []

        def run_shared() -> None:
            shared_out.append(self.shared_experts(hidden_states))

        overlap_at = self.shared_experts_overlap if overlap_shared else None

        dbo_maybe_run_recv_hook()
        hook, receive_tokens = pf.prepare_async(hidden_states, topk_weights, topk_ids, use_fp8=self.use_fp8_dispatch)
        self._receive(hook, overlap=run_shared if overlap_at == "dispatch" else None)
        tokens = receive_tokens()

        expert_out = self.experts.apply(tokens, w1, w2)

        dbo_maybe_run_recv_hook()
        hook, receive_output = pf.finalize_async(expert_out, tokens, topk_weights, topk_ids)
        self._receive(hook, overlap=run_shared if overlap_at == "combine" else None)
        out = receive_output()

        if self.shared_experts is not None:
            if not shared_out:
                run_shared()
            out = out + shared_out[0]
        return out

    __call__ = forward
