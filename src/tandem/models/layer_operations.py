"""Decoder layers and models as TBO operations (SGLang's `operations_strategy.py`).

`DecoderLayerOperations` is mixed into a pre-norm MoE decoder layer (input norm →
attention → residual → post-attention norm → MLP or MoE → residual). Its operations carry
`{"hidden_states", "residual", "positions"}` from layer to layer, the MLP output and the
residual unsummed as the layer's forward hands them on (the next layer's input norm adds
them, fused; the first layer gets no residual), and keep what a later stage needs in the
ubatch's state; the MoE ones are the kernel's steps (`dispatch_prepare`, `dispatch_send`, ...).

Strategies, as SGLang cuts them (`|` is a `YieldOperation`; lists of consecutive layers are
concatenated, so a layer's last stage and the next layer's first are one stage):

- with shared experts (DeepSeek-V2/V3, Qwen2-MoE), decode, delta 2: attention prepare |
  attention core, gate, select | dispatch send, shared experts | dispatch receive, experts,
  combine send | combine receive | output;
- with shared experts, prefill, delta 0: attention, gate, select, dispatch send | dispatch
  receive, experts, combine send | shared experts, combine receive, output;
- the dispatch is two steps, as SGLang's `dispatch_a` / `dispatch_b`: `dispatch_prepare` (the
  backend's casts and its record of this ubatch's compute) at the end of the routing, then
  `dispatch_send`. Where the send holds the host (the backend `yields_in_send`: DeepEP's
  normal kernels wait on the CPU for the peers' counts), prefill issues it after the yield,
  so the other ubatch's stage is queued first, and the combine send one stage later, so the
  other ubatch's dispatch is ahead of it on the library's one comm stream: attention, gate,
  select | dispatch send, dispatch receive, experts | combine send, shared experts, combine
  receive, output (`tandem simulate`, H800 EP32 16K: TBO prefill 7,654 -> 8,121 tok/s/GPU;
  with the combine left in the experts' stage, 6,515). Decode sends after a yield anyway;
- without (Qwen3-MoE, Mixtral), decode, delta 2: attention prepare | attention core, gate,
  select | dispatch send | dispatch receive, experts, combine send | combine receive,
  output |; prefill as above without the shared experts;
- a dense layer between MoE layers: its operations with no yield (nothing to overlap).

`OperationsModel` gives a model the three methods `UBatchWrapper` runs TBO with: the
embedding and the leading dense layers (`first_k_dense_replace`) on the whole batch, outside
the overlap as in SGLang (their `hidden_states` and `residual` are cut by tokens like every
input); the strategy of the remaining layers; the final norm, with the last add, on each
ubatch's output before the ubatches are concatenated.
"""

from __future__ import annotations

import torch

from tandem.contexts import OperationsStrategy, YieldOperation, execute_operations

DECODE_DELTA_STAGES = 2
PREFILL_DELTA_STAGES = 0


def _kernel_step(name: str, step: str):
    """The operation `op_{name}`: the MoE kernel's `step` on this ubatch's layer call."""

    def op(self, state: dict) -> dict:
        getattr(self.feed_forward.kernel, step)(state["moe"])
        return {}

    op.__name__, op.__qualname__ = f"op_{name}", f"DecoderLayerOperations.op_{name}"
    return op


class DecoderLayerOperations:
    """Operations of a decoder layer that has `input_layernorm`, `self_attn.prepare(positions,
    x)`, `attention_core(prepared)`, `post_attention_layernorm` and `feed_forward` (a dense
    MLP, or an MoE block with `router_logits`, `select`, `expert_weights` and `kernel`)."""

    @property
    def is_sparse(self) -> bool:
        return getattr(self.feed_forward, "kernel", None) is not None

    # -- attention -----------------------------------------------------------------------

    def op_comm_prepare_attn(
        self, state: dict, hidden_states: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None = None
    ) -> dict:
        state["positions"] = positions
        if residual is None:
            state["residual"] = hidden_states
            return {"hidden_states": self.input_layernorm(hidden_states)}
        normed, state["residual"] = self.input_layernorm(hidden_states, residual)
        return {"hidden_states": normed}

    def op_attn_prepare(self, state: dict, hidden_states: torch.Tensor) -> dict:
        state["attention"] = self.self_attn.prepare(state["positions"], hidden_states)
        return {}

    def op_attn_core(self, state: dict) -> dict:
        return {"attn_output": self.attention_core(state.pop("attention"))}

    def op_comm_prepare_mlp(self, state: dict, attn_output: torch.Tensor) -> dict:
        normed, state["residual"] = self.post_attention_layernorm(attn_output, state["residual"])
        return {"hidden_states": normed}

    # -- MLP / MoE -----------------------------------------------------------------------

    def op_dense_mlp(self, state: dict, hidden_states: torch.Tensor) -> dict:
        return {"mlp_output": self.feed_forward(hidden_states)}

    def op_gate(self, state: dict, hidden_states: torch.Tensor) -> dict:
        state["moe_input"] = hidden_states
        return {"router_logits": self.feed_forward.router_logits(hidden_states)}

    def op_select_experts(self, state: dict, router_logits: torch.Tensor) -> dict:
        state["topk"] = self.feed_forward.select(router_logits)
        return {}

    def op_dispatch_prepare(self, state: dict) -> dict:
        moe = self.feed_forward
        state["moe"] = moe.kernel.dispatch_prepare(state.pop("moe_input"), *moe.expert_weights, *state.pop("topk"))
        return {}

    op_dispatch_send = _kernel_step("dispatch_send", "dispatch_send")
    op_shared_experts = _kernel_step("shared_experts", "compute_shared")
    op_dispatch_recv = _kernel_step("dispatch_recv", "dispatch_recv")
    op_experts = _kernel_step("experts", "compute_experts")
    op_combine_send = _kernel_step("combine_send", "combine_send")
    op_combine_recv = _kernel_step("combine_recv", "combine_recv")

    def op_output(self, state: dict) -> dict:
        return {"mlp_output": self.feed_forward.kernel.output(state.pop("moe"))}

    def op_comm_postprocess_layer(self, state: dict, mlp_output: torch.Tensor) -> dict:
        return {"hidden_states": mlp_output, "residual": state.pop("residual"), "positions": state.pop("positions")}

    # -- strategies ----------------------------------------------------------------------

    def operations_strategy(self, decode: bool) -> OperationsStrategy:
        delta = DECODE_DELTA_STAGES if decode else PREFILL_DELTA_STAGES
        attention = [self.op_comm_prepare_attn, self.op_attn_prepare, self.op_attn_core, self.op_comm_prepare_mlp]
        if not self.is_sparse:
            return OperationsStrategy([*attention, self.op_dense_mlp, self.op_comm_postprocess_layer], delta)
        Y = YieldOperation
        route = [self.op_gate, self.op_select_experts, self.op_dispatch_prepare]
        experts = [self.op_dispatch_recv, self.op_experts, self.op_combine_send]
        shared = [self.op_shared_experts] if self.feed_forward.kernel.shared_experts is not None else []
        finish = [self.op_output, self.op_comm_postprocess_layer]
        if not decode and self.feed_forward.kernel.prepare_finalize.yields_in_send:
            # The send holds the host (DeepEP's normal dispatch): issued after the yield, the
            # other ubatch's stage is queued on the device while the host waits in it. The
            # library's transfers share one stream in issue order, so the combine goes to the
            # next stage: after the other ubatch's dispatch, not before it (behind these experts).
            ops = [
                *attention, *route, Y(), self.op_dispatch_send, *experts[:2], Y(),
                self.op_combine_send, *shared, self.op_combine_recv, *finish,
            ]  # fmt: skip
        elif not decode:
            ops = [*attention, *route, self.op_dispatch_send, Y(), *experts, Y(), *shared, self.op_combine_recv, *finish]
        elif shared:
            ops = [
                *attention[:2], Y(), *attention[2:], *route, Y(), self.op_dispatch_send, *shared, Y(),
                *experts, Y(), self.op_combine_recv, Y(), *finish,
            ]  # fmt: skip
        else:
            ops = [
                *attention[:2], Y(), *attention[2:], *route, Y(), self.op_dispatch_send, Y(),
                *experts, Y(), self.op_combine_recv, *finish, Y(),
            ]  # fmt: skip
        return OperationsStrategy(ops, delta)


class OperationsModel:
    """For a causal LM whose `self.model` has `embed_tokens`, `layers` (each a
    `DecoderLayerOperations`) and `norm`: what `UBatchWrapper` runs TBO with."""

    def _first_overlapped_layer(self) -> int:
        layers = self.model.layers
        return next((i for i, layer in enumerate(layers) if layer.is_sparse), len(layers))

    def operations_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> dict:
        """Embedding and the leading dense layers, on the whole batch."""
        inputs = {"hidden_states": self.model.embed_tokens(input_ids), "positions": positions}
        for layer in self.model.layers[: self._first_overlapped_layer()]:
            inputs = execute_operations(inputs, layer.operations_strategy(decode=False).operations)
        return inputs

    def operations_strategy(self, decode: bool) -> OperationsStrategy:
        layers = self.model.layers[self._first_overlapped_layer() :]
        if len(layers) == 0:
            raise ValueError(f"{type(self).__name__} has no MoE layer, so nothing for two-batch overlap to overlap")
        return OperationsStrategy.concat([layer.operations_strategy(decode) for layer in layers])

    def operations_output(self, outputs: dict) -> torch.Tensor:
        """One ubatch's output (`UBatchWrapper` concatenates them after): the final norm, adding
        the last layer's residual as the forward does, row by row, so the ubatches' residuals
        are never concatenated and nothing of the sum is kept (`RMSNorm.add_norm`)."""
        return self.model.norm.add_norm(outputs["hidden_states"], outputs["residual"])


__all__ = ["DECODE_DELTA_STAGES", "PREFILL_DELTA_STAGES", "DecoderLayerOperations", "OperationsModel"]
