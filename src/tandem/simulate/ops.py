"""The cost of each operation of a decoder layer, for one ubatch on one rank.

Operation names are the runtime's: the layer's `op_*` methods (`models/layer_operations.py`)
without the prefix, and the MoE kernel's steps (`FusedMoEModularKernel`: `dispatch_send`,
`compute_experts` as "experts", ...). A compute op costs the larger of FLOPs over the
achieved rate and bytes over HBM bandwidth (`HardwareProfile`); a send costs its bytes per
rank over the EP layout's bottleneck link; a receive costs nothing itself (it waits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.simulate.hardware import HardwareProfile
from tandem.simulate.model_shape import ModelShape

SENDS = {"dispatch_send": "dispatch", "combine_send": "combine"}
RECEIVES = {"dispatch_recv": "dispatch", "combine_recv": "combine"}
BF16 = 2


@dataclass(frozen=True)
class UBatchWork:
    """One ubatch on one rank: its tokens, requests, and the attention work of its tokens
    (`attended`: the sum over its query tokens of the keys each attends to)."""

    tokens: int
    requests: int
    attended: int


@dataclass(frozen=True)
class Layout:
    """DP-attention x EP: every rank runs attention on its own tokens (TP 1) and holds
    `experts / ep` routed experts."""

    ep: int
    decode: bool
    low_latency: bool


class OpCosts:
    """Seconds of each operation of a layer for a ubatch, on one hardware profile."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, layout: Layout, *, sm_share: float = 1.0):
        self.shape, self.hw, self.layout, self.sm_share = shape, hw, layout, sm_share

    def _gemm(self, m: float, n: int, k: int, groups: int = 1, fp8: bool = True) -> float:
        return self.hw.gemm_time(m, n, k, groups=groups, fp8=fp8, sm_share=self.sm_share)

    def _norm(self, tokens: int, passes: int = 2) -> float:
        return self.hw.memory_time(tokens * self.shape.hidden * BF16 * passes)

    def compute(self, name: str, work: UBatchWork) -> float:
        method = getattr(self, f"_op_{name}", None)
        if method is None:
            raise KeyError(f"the simulator has no cost for operation {name!r}")
        return method(work) if work.tokens else 0.0

    # -- attention -----------------------------------------------------------------------

    def _op_comm_prepare_attn(self, w: UBatchWork) -> float:
        return self._norm(w.tokens)

    def _op_attn_prepare(self, w: UBatchWork) -> float:
        s, t = self.shape, w.tokens
        if s.attention == "gqa":
            return self._gemm(t, (s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden)
        q_in = s.q_lora or s.hidden
        time = self._gemm(t, (s.q_lora or 0) + s.kv_lora + s.rope, s.hidden)  # fused q_a + kv_a
        time += self._gemm(t, s.heads * (s.nope + s.rope), q_in)  # q_b
        if self.layout.decode:  # absorbed: q_nope x W_UK per head (BF16 batched)
            time += self._gemm(t, s.kv_lora, s.nope, groups=s.heads, fp8=False)
        else:  # expanded keys/values: kv_b
            time += self._gemm(t, s.heads * (s.nope + s.v_dim), s.kv_lora)
        return time

    def _op_attn_core(self, w: UBatchWork) -> float:
        s, t = self.shape, w.tokens
        o_proj = self._gemm(t, s.hidden, s.heads * s.v_dim)
        if not self.layout.decode:
            flops = 2.0 * s.heads * (s.head_dim + s.v_dim) * w.attended
            return self.hw.prefill_attention_time(flops, self.sm_share) + o_proj
        if s.attention == "mla":  # FlashMLA on the latent cache, then W_UV per head
            width = s.kv_lora + s.rope
            flops = 2.0 * s.heads * (width + s.kv_lora) * w.attended
            core = self.hw.decode_attention_time(flops, w.attended * width * BF16, self.sm_share)
            return core + self._gemm(t, s.v_dim, s.kv_lora, groups=s.heads, fp8=False) + o_proj
        flops = 4.0 * s.heads * s.head_dim * w.attended
        kv_bytes = w.attended * 2 * s.kv_heads * s.head_dim * BF16
        return self.hw.decode_attention_time(flops, kv_bytes, self.sm_share) + o_proj

    def _op_comm_prepare_mlp(self, w: UBatchWork) -> float:
        return self._norm(w.tokens, passes=3)

    # -- MLP / MoE -----------------------------------------------------------------------

    def _op_dense_mlp(self, w: UBatchWork) -> float:
        s = self.shape
        return self._gemm(w.tokens, 2 * s.intermediate, s.hidden) + self._gemm(w.tokens, s.hidden, s.intermediate)

    def _op_gate(self, w: UBatchWork) -> float:
        return self._gemm(w.tokens, self.shape.experts, self.shape.hidden, fp8=False)

    def _op_select_experts(self, w: UBatchWork) -> float:
        return self.hw.memory_time(w.tokens * self.shape.experts * 4 * 2)

    def local_experts(self) -> int:
        return max(1, math.ceil(self.shape.experts / self.layout.ep))

    def _op_experts(self, w: UBatchWork) -> float:
        s, local = self.shape, self.local_experts()
        # Balanced routing (as DeepSeek's profile): every rank receives tokens x top-k rows.
        m = w.tokens * s.top_k / local
        time = self._gemm(m, 2 * s.moe_intermediate, s.hidden, groups=local)
        time += self._gemm(m, s.hidden, s.moe_intermediate, groups=local)
        return time + self.hw.memory_time(w.tokens * s.top_k * 2 * s.moe_intermediate * BF16 * 2)

    def _op_shared_experts(self, w: UBatchWork) -> float:
        s = self.shape
        if not s.shared_intermediate:
            return 0.0
        return self._gemm(w.tokens, 2 * s.shared_intermediate, s.hidden) + self._gemm(w.tokens, s.hidden, s.shared_intermediate)

    def _op_output(self, w: UBatchWork) -> float:
        return self._norm(w.tokens, passes=3)

    def _op_comm_postprocess_layer(self, w: UBatchWork) -> float:
        return self._norm(w.tokens, passes=3)

    def _op_head(self, w: UBatchWork) -> float:
        """Final norm and lm_head on the last token of each request (prefill) or every token (decode)."""
        rows = w.tokens if self.layout.decode else w.requests
        return self._norm(w.tokens) + self._gemm(rows, self.shape.vocab, self.shape.hidden, fp8=False)

    # -- communication -------------------------------------------------------------------

    def destinations(self) -> float:
        """Copies of a token a transfer moves: one per expert for the low-latency kernels; one
        per destination node (normal kernels across nodes, NVLink forwards inside), or per
        rank inside one node; uniform routing, limited to `topk_group` groups/nodes."""
        s, ep = self.shape, self.layout.ep
        if self.layout.low_latency:
            return float(s.top_k)
        per_node = self.hw.gpus_per_node
        targets = ep if ep <= per_node else max(1, ep // per_node)
        expected = targets * (1.0 - (1.0 - 1.0 / targets) ** s.top_k)
        return min(expected, float(s.topk_group)) if s.topk_group and ep > per_node else expected

    def transfer_bytes(self, kind: str, work: UBatchWork) -> float:
        hidden, element = self.shape.hidden, self.hw.figures.get("element_bytes")
        if element:  # a profile that computes in one dtype throughout (a CPU host) sends it unquantized
            per_copy = hidden * element
        else:
            per_copy = hidden + hidden // 128 * 4 if kind == "dispatch" else hidden * BF16  # FP8 + scales / BF16
        return work.tokens * self.destinations() * per_copy

    def transfer(self, kind: str, work: UBatchWork) -> float:
        layout = self.layout
        return self.hw.transfer_time(kind, self.transfer_bytes(kind, work), ep=layout.ep, low_latency=layout.low_latency)


__all__ = ["RECEIVES", "SENDS", "Layout", "OpCosts", "UBatchWork"]
