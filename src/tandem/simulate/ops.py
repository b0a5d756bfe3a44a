"""The cost of each operation of a decoder layer, for one ubatch on one rank.

Operation names are the runtime's: the layer's `op_*` methods (`models/layer_operations.py`)
without the prefix, and the MoE kernel's steps (`FusedMoEModularKernel`: `dispatch_send`,
`compute_experts` as "experts", ...). A compute op costs the larger of FLOPs over the
achieved rate and bytes over HBM bandwidth (`HardwareProfile`); a send costs its bytes per
rank over the EP layout's bottleneck link; a receive costs nothing itself (it waits).
On a host with measured elementwise lines (`--hardware here`), the MoE stack's non-GEMM work is
counted from its own operations and priced on them (`simulate.host_elementwise`) instead of the
norm passes below. The norm passes themselves are counted from the runtime's layer code
(`layer_norm_passes`): since G9 a layer hands (hidden, residual) on unsummed and the next input
norm adds them in its one kernel, so the residual add is no op of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from tandem.bench.moe_stack import MOE_STACK
from tandem.models.layer_operations import DecoderLayerOperations, OperationsModel
from tandem.modular_kernels.interfaces import PrepareAndFinalize
from tandem.modular_kernels.kernel import FusedMoEModularKernel
from tandem.modular_kernels.prepare_deepep import DeepEPHighThroughputPrepareAndFinalize, DeepEPLowLatencyPrepareAndFinalize
from tandem.modular_kernels.prepare_torch_a2a import TorchAllToAllPrepareAndFinalize
from tandem.simulate.hardware import HardwareProfile
from tandem.simulate.host_elementwise import ElementwiseFit, traced_op_time
from tandem.simulate.host_experts import FusedExpertsFit
from tandem.simulate.kernel_trace import COMBINE_BLOCK
from tandem.simulate.model_shape import ModelShape

#: Each transfer's kind by the step that sends it; combine-down-gemm sends the combine per block.
SENDS = {"dispatch_send": "dispatch", "combine_send": "combine", COMBINE_BLOCK: "combine"}
RECEIVES = {"dispatch_recv": "dispatch", "combine_recv": "combine"}
BF16 = 2
#: The payload `rdma_low_latency_sm_s` was measured at (h800.json's source): DeepSeek-V3's
#: low-latency calls of 128 tokens, each token sent to its 8 experts, 7,168 hidden (FP8 with
#: scales out, BF16 back). A call's SM time scales with its bytes against this payload's.
LOW_LATENCY_TABLE_TOKENS, LOW_LATENCY_TABLE_COPIES, LOW_LATENCY_TABLE_HIDDEN = 128, 8, 7168


class _Hidden:
    """A hidden-sized activation of one token, standing in for a tensor while the runtime's
    own op methods run: a sum of two reads both and writes one (3 passes)."""

    def __init__(self, passes: list[int]):
        self.passes = passes

    def __add__(self, other: "_Hidden") -> "_Hidden":
        self.passes.append(3)
        return _Hidden(self.passes)


class _Norm:
    """Stands in for `RMSNorm` (`models/norm.py`): one kernel that reads each tensor it is given
    and writes each it returns. With a residual: x and residual in, (normed, sum) out, 4 passes;
    alone, 2. `add_norm` (the final norm) returns the normed rows only, but its CUDA kernel
    still writes the sum, to a buffer of its own (`add_rms_norm`): 4."""

    def __init__(self, passes: list[int]):
        self.passes = passes

    def __call__(self, x: _Hidden, residual: _Hidden | None = None):
        if residual is None:
            self.passes.append(2)
            return _Hidden(self.passes)
        self.passes.append(4)
        return _Hidden(self.passes), _Hidden(self.passes)

    def add_norm(self, x: _Hidden, residual: _Hidden) -> _Hidden:
        self.passes.append(4)
        return _Hidden(self.passes)


class _LayerTrace(DecoderLayerOperations):
    """A MoE decoder layer with recording norms and a kernel whose `output` is the real one."""

    def __init__(self, passes: list[int]):
        self.input_layernorm = self.post_attention_layernorm = _Norm(passes)
        kernel = SimpleNamespace(compute_shared=lambda state: None)
        kernel.output = lambda state: FusedMoEModularKernel.output(kernel, state)
        self.feed_forward = SimpleNamespace(kernel=kernel)


def layer_norm_passes(shared: bool) -> dict[str, int]:
    """Hidden-sized BF16 passes per token of each norm-like op of a MoE layer past the first,
    counted by running the runtime's own op methods (`DecoderLayerOperations`) and the MoE
    kernel's `output` on recording stand-ins, so the priced ops are the ones the layer issues.
    Since G9: the input norm adds the previous layer's residual (4), the post-attention norm
    adds this one's (4), `output` adds the shared experts' output (3; 0 without them), and
    `comm_postprocess_layer` hands both on unsummed (0). The first layer's input norm has no
    residual (2 passes); it is priced as the others' (the op model prices an op by its name)."""
    out: dict[str, int] = {}
    for name in ("comm_prepare_attn", "comm_prepare_mlp", "output", "comm_postprocess_layer"):
        passes: list[int] = []
        layer, x = _LayerTrace(passes), _Hidden(passes)
        state = {"residual": _Hidden(passes), "positions": None}
        if name == "comm_prepare_attn":
            layer.op_comm_prepare_attn(state, x, None, _Hidden(passes))
        elif name == "output":
            moe = SimpleNamespace(routed_output=x, shared_output=_Hidden(passes) if shared else None, shared_folded=False)
            layer.op_output({"moe": moe})
        else:
            getattr(layer, f"op_{name}")(state, x)
        out[name] = sum(passes)
    return out


def final_norm_passes() -> int:
    """Passes per token of the model's final norm, as `OperationsModel.operations_output` runs
    it on the last layer's unsummed (hidden, residual)."""
    passes: list[int] = []
    model = SimpleNamespace(model=SimpleNamespace(norm=_Norm(passes)))
    OperationsModel.operations_output(model, {"hidden_states": _Hidden(passes), "residual": _Hidden(passes)})
    return sum(passes)


#: The norm passes of a DeepSeek-V3 layer (shared experts) as the runtime issues them; a
#: profile's `elementwise_passes` (every kernel besides attention, GEMMs and the experts,
#: measured on DeepSeek-V3) scales each op's passes to its measured total.
NORM_PASSES = sum(layer_norm_passes(shared=True).values())
FINAL_NORM_PASSES = final_norm_passes()


def copy_bytes(kind: str, hidden: int, element: float | None = None) -> float:
    """Bytes of one token's copy in a transfer: `element` bytes per value when the profile
    computes in one dtype throughout (a CPU host, unquantized), else FP8 with one float32 scale
    per 128 values (dispatch) or BF16 (combine)."""
    if element:
        return hidden * element
    return hidden + hidden // 128 * 4 if kind == "dispatch" else hidden * BF16


def low_latency_table_bytes(kind: str) -> float:
    """Bytes per rank of the low-latency call `rdma_low_latency_sm_s` was measured at."""
    return LOW_LATENCY_TABLE_TOKENS * LOW_LATENCY_TABLE_COPIES * copy_bytes(kind, LOW_LATENCY_TABLE_HIDDEN)


@dataclass(frozen=True)
class UBatchWork:
    """One ubatch on one rank: its tokens, requests, and the attention work of its tokens
    (`attended`: the sum over its query tokens of the keys each attends to; `keys_read`: the
    cached keys decode reads, once per request however many of its tokens attend to them)."""

    tokens: int
    requests: int
    attended: int
    keys_read: int | None = None

    @property
    def kv_keys(self) -> int:
        return self.attended if self.keys_read is None else self.keys_read


@dataclass(frozen=True)
class Layout:
    """DP-attention x EP: every rank runs attention on its own tokens (TP 1) and holds
    `experts / ep` routed experts."""

    ep: int
    decode: bool
    low_latency: bool


class OpCosts:
    """Seconds of each operation of a layer for a ubatch, on one hardware profile."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, layout: Layout, *, sm_share: float = 1.0, overlapped: bool = False):
        self.shape, self.hw, self.layout, self.sm_share, self.overlapped = shape, hw, layout, sm_share, overlapped
        self.elementwise_scale = float(hw.figures.get("elementwise_passes", NORM_PASSES)) / NORM_PASSES
        #: A host's measured elementwise lines, for a model whose ops the simulator can count
        #: from its code (the MoE stack): they replace the norm passes and the memory terms below.
        self.traced = ElementwiseFit.from_figures(hw.figures) if shape.name == MOE_STACK else None
        #: A host's measured fused CPU experts, for a model the runtime runs them for (its
        #: experts are parameters; the MoE stack's are plain tensors and take torch's GEMMs).
        self.fused = None if shape.name == MOE_STACK else FusedExpertsFit.from_figures(hw.figures)
        self.norm_passes = layer_norm_passes(shared=shape.shared_intermediate > 0)

    def _gemm(self, m: float, n: int, k: int, groups: int = 1, fp8: bool = True) -> float:
        return self.hw.gemm_time(m, n, k, groups=groups, fp8=fp8, sm_share=self.sm_share)

    def _memory(self, nbytes: float) -> float:
        """A memory-bound pass's time, or 0 where the measured elementwise lines price the op's
        non-GEMM work instead (`traced_op_time`, added in `compute`)."""
        if self.traced is not None:
            return 0.0
        return self.hw.memory_time(nbytes)

    def _norm(self, name: str, tokens: int) -> float:
        """Op `name`'s passes as the runtime's layer issues them, scaled to the profile's total."""
        return self._memory(tokens * self.shape.hidden * BF16 * self.norm_passes[name] * self.elementwise_scale)

    def compute(self, name: str, work: UBatchWork) -> float:
        method = getattr(self, f"_op_{name}", None)
        if method is None:
            raise KeyError(f"the simulator has no cost for operation {name!r}")
        if not work.tokens:
            return 0.0
        if self.traced is None:
            return method(work)
        return method(work) + traced_op_time(self.traced, name, work.tokens, self.layout.ep)

    # -- attention -----------------------------------------------------------------------

    def _op_comm_prepare_attn(self, w: UBatchWork) -> float:
        return self._norm("comm_prepare_attn", w.tokens)

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
        if self.layout.decode and s.attention == "mla":  # FlashMLA on the latent cache, then W_UV per head
            o_proj += self._gemm(t, s.v_dim, s.kv_lora, groups=s.heads, fp8=False)
        return self.attention_kernel(w) + o_proj

    def attention_kernel(self, w: UBatchWork) -> float:
        """The attention kernel alone (FlashAttention / FlashMLA), without the projections."""
        s = self.shape
        if not self.layout.decode:
            return self.hw.prefill_attention_time(2.0 * s.heads * (s.head_dim + s.v_dim) * w.attended, self.sm_share)
        if s.attention == "mla":
            width = s.kv_lora + s.rope
            flops = 2.0 * s.heads * (width + s.kv_lora) * w.attended
            return self.hw.decode_attention_time(flops, w.kv_keys * width * BF16, self.sm_share)
        kv_bytes = w.kv_keys * 2 * s.kv_heads * s.head_dim * BF16
        return self.hw.decode_attention_time(4.0 * s.heads * s.head_dim * w.attended, kv_bytes, self.sm_share)

    def _op_comm_prepare_mlp(self, w: UBatchWork) -> float:
        return self._norm("comm_prepare_mlp", w.tokens)

    # -- MLP / MoE -----------------------------------------------------------------------

    def _op_dense_mlp(self, w: UBatchWork) -> float:
        s = self.shape
        return self._gemm(w.tokens, 2 * s.intermediate, s.hidden) + self._gemm(w.tokens, s.hidden, s.intermediate)

    def _op_gate(self, w: UBatchWork) -> float:
        return self._gemm(w.tokens, self.shape.experts, self.shape.hidden, fp8=False)

    def _op_select_experts(self, w: UBatchWork) -> float:
        return self._memory(w.tokens * self.shape.experts * 4 * 2)

    def local_experts(self) -> int:
        return max(1, math.ceil(self.shape.experts / self.layout.ep))

    def _op_experts(self, w: UBatchWork) -> float:
        if self.fused is not None:
            s = self.shape
            return self.fused.time(tokens=w.tokens, top_k=s.top_k, local_experts=self.local_experts(), hidden=s.hidden,
                                   intermediate=s.moe_intermediate, element=float(self.hw.figures.get("element_bytes", 4)))
        return self.gemm_experts(w)

    def torch_path_experts(self, w: UBatchWork) -> float:
        """The routed experts as the runtime runs them without the fused CPU kernel (its torch
        path, which SBO's blocks always take): `compute("experts")` without `fused`."""
        traced = traced_op_time(self.traced, "experts", w.tokens, self.layout.ep) if self.traced is not None else 0.0
        return self.gemm_experts(w) + traced

    def gemm_experts(self, w: UBatchWork) -> float:
        """The routed experts as a GEMM per expert and projection."""
        s, local = self.shape, self.local_experts()
        # Balanced routing (as DeepSeek's profile): every rank receives tokens x top-k rows.
        m = w.tokens * s.top_k / local
        time = self._gemm(m, 2 * s.moe_intermediate, s.hidden, groups=local)
        time += self.down_projection(w)
        return time + self._memory(w.tokens * s.top_k * 2 * s.moe_intermediate * BF16 * 2)

    def down_projection(self, w: UBatchWork, blocks: int = 1) -> float:
        """The routed experts' down GEMM on one of `blocks` equal shares of the rows every local
        expert received (combine-down-gemm's blocks: `block_combine`), priced at those rows, so
        each block pays a smaller GEMM's rate and reads its weights again."""
        s, local = self.shape, self.local_experts()
        return self._gemm(w.tokens * s.top_k / local / blocks, s.hidden, s.moe_intermediate, groups=local)

    def _op_shared_experts(self, w: UBatchWork) -> float:
        s = self.shape
        if not s.shared_intermediate:
            return 0.0
        return self._gemm(w.tokens, 2 * s.shared_intermediate, s.hidden) + self._gemm(w.tokens, s.hidden, s.shared_intermediate)

    def _op_output(self, w: UBatchWork) -> float:
        return self._norm("output", w.tokens)

    def _op_comm_postprocess_layer(self, w: UBatchWork) -> float:
        return self._norm("comm_postprocess_layer", w.tokens)

    def _op_head(self, w: UBatchWork) -> float:
        """Final norm (adding the last layer's residual) and lm_head on the last token of each
        request (prefill) or every token (decode)."""
        rows = w.tokens if self.layout.decode else w.requests
        norm = self._memory(w.tokens * self.shape.hidden * BF16 * FINAL_NORM_PASSES)
        return norm + self._gemm(rows, self.shape.vocab, self.shape.hidden, fp8=False)

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
        per_copy = copy_bytes(kind, self.shape.hidden, self.hw.figures.get("element_bytes"))
        return work.tokens * self.destinations() * per_copy

    def transfer(self, kind: str, work: UBatchWork) -> float:
        """The transfer's time on the comm stream: a low-latency call less its kernels' SM
        time (`send_kernel`, on the compute stream); a normal call across nodes at the share
        of its table bandwidth it keeps while compute overlaps (`normal_overlap_bandwidth`),
        plus its barrier (`normal_barrier_share` of its time at the table's bandwidth), both
        measured in DeepSeek's prefill profile."""
        layout, figures = self.layout, self.hw.figures
        seconds = self.hw.transfer_time(kind, self.transfer_bytes(kind, work), ep=layout.ep, low_latency=layout.low_latency)
        if not seconds or layout.low_latency:
            return seconds - self.send_kernel(kind, work)
        if layout.ep <= self.hw.gpus_per_node:
            return seconds
        barrier = seconds * figures.get("normal_barrier_share", {}).get(kind, 0.0)
        if self.overlapped:
            seconds /= figures.get("normal_overlap_bandwidth", {}).get(kind, 1.0)
        return seconds + barrier

    def backend(self) -> type[PrepareAndFinalize]:
        """The runtime's transfer backend for this layout: gloo's `torch_a2a` where the host's
        cores move the data, else DeepEP's low-latency or normal (high-throughput) kernels."""
        if self.hw.transfers_on_compute:
            return TorchAllToAllPrepareAndFinalize
        return DeepEPLowLatencyPrepareAndFinalize if self.layout.low_latency else DeepEPHighThroughputPrepareAndFinalize

    def host_wait(self, kind: str, work: UBatchWork) -> float | None:
        """How long after a send's transfer starts the host is held inside the call; None where
        the call returns at once. DeepEP's normal dispatch launches its notify kernel, then
        busy-waits on the CPU for the received counts it writes before it can allocate the
        receive buffers and launch the dispatch (DeepEP docs/legacy.md: "an implicit CPU wait for
        GPU received count signal"; figure normal.png: launch notify, waiting, tensor allocation,
        launch dispatch). The notify is the call's barrier (`normal_barrier_share`, the profile's
        Dispatch Barrier); the intranode notify has no figure (not held). gloo's dispatch
        (`torch_a2a`) exchanges its split sizes with a synchronous all-to-all on the issuing
        thread, which crosses the link behind every byte already queued on it (TCP is FIFO): the
        host is held until the transfer starts (0). Combines reuse the dispatch's layout and
        never wait; the low-latency kernels never wait."""
        if kind != "dispatch":
            return None
        if self.backend() is TorchAllToAllPrepareAndFinalize:
            return 0.0
        if self.backend() is not DeepEPHighThroughputPrepareAndFinalize or self.layout.ep <= self.hw.gpus_per_node:
            return None
        wire = self.hw.transfer_time(kind, self.transfer_bytes(kind, work), ep=self.layout.ep, low_latency=False)
        return wire * self.hw.figures.get("normal_barrier_share", {}).get(kind, 0.0)

    def send_kernel(self, kind: str, work: UBatchWork) -> float:
        """A low-latency call's SM time (packing, sending, receiving) on the compute stream:
        the profile's `rdma_low_latency_sm_s`, measured at DeepSeek-V3's payload
        (`low_latency_table_bytes`), in proportion to the call's bytes; never more than the
        call's own time, of which it is a part."""
        if not self.layout.low_latency or self.layout.ep <= 1:
            return 0.0
        per_call = self.hw.figures.get("rdma_low_latency_sm_s", {}).get(kind, 0.0)
        if not per_call:
            return 0.0
        payload = self.transfer_bytes(kind, work)
        call = self.hw.transfer_time(kind, payload, ep=self.layout.ep, low_latency=True)
        return min(max(per_call * payload / low_latency_table_bytes(kind), 0.0), call)


__all__ = [
    "FINAL_NORM_PASSES", "NORM_PASSES", "RECEIVES", "SENDS", "Layout", "OpCosts", "UBatchWork", "copy_bytes",
    "final_norm_passes", "layer_norm_passes", "low_latency_table_bytes",
]  # fmt: skip
