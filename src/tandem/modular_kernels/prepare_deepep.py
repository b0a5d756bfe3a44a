"""Dispatch/combine over DeepEP (`deep_ep.Buffer`): low-latency (masked layout, receive
hooks) and high-throughput (standard layout, events).

DeepEP is imported lazily when an adapter is built; without it (or when its import fails in
any way: DeepEP asserts on NCCL and CUDA_HOME at import) the constructor raises an
ImportError that says how to get it. The adapters share one Buffer per process per (group,
mode), and the low-latency kernels limit the token budget and hidden size: both are
`deepep_buffers`'s.

Dtypes. DeepEP's kernels move bf16 only (fp8 with `use_fp8`): the adapters cast the tokens
to bf16 before dispatch and the expert output to bf16 before combine, and hand results
back in the model's dtype. Top-k ids go in as `deep_ep.topk_idx_t`.

No host sync. Dispatch and combine read no device value on the host; the byte count that
drives a modelled fabric is only computed when a fabric is set and no graph capture runs.

High throughput under DBO follows vLLM's order: record the ubatch's compute on an event,
yield and move to the comm stream (the dispatch spins the CPU until the peers' counts
arrive, so the other ubatch queues its compute first), dispatch synchronously on the comm
stream, then move back to the compute stream behind it; combine likewise. Its dispatch comes
in two halves (`prepare_before_send`, SGLang's `dispatch_a` / `dispatch_b`): the casts and the
compute event, then the layout and the blocking dispatch, which TBO's operation lists run
after the stage's yield. Its CPU wait
makes it impossible to capture in a CUDA graph (`graph_capturable = False`).

On CPU, `tandem.testing.fake_deep_ep.install()` puts an emulation of DeepEP's API in place.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tandem.contexts import dbo_enabled, dbo_switch_to_compute_sync, dbo_yield_and_switch_from_compute_to_comm
from tandem.contexts.time_model import timed_receive
from tandem.modular_kernels.deepep_buffers import (
    DEEPEP_DTYPE,
    DEFAULT_LL_MAX_TOKENS_PER_RANK,
    check_low_latency_budget,
    check_low_latency_hidden_size,
    check_low_latency_step_budget,
    ht_buffer_sms_limit,
    import_deep_ep,
    release_shared_buffers,
    shared_buffer,
)
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import ActivationFormat, ExpertTokens, PrepareAndFinalize, require_process_group, RecvHook
from tandem.modular_kernels.quant import quantize_fp8_per_token_group
from tandem.platform import graph_capture_active


class _DeepEPPrepareAndFinalize(PrepareAndFinalize):
    compiles_on_first_use = True
    def __init__(self, num_experts: int, group=None, buffer=None, fabric: FabricModel | None = None):
        self._deep_ep = import_deep_ep(self.name)
        if group is None:
            require_process_group(self.name, group)
            group = dist.group.WORLD
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self.fabric = fabric
        self._topk_idx_t = getattr(self._deep_ep, "topk_idx_t", torch.int64)
        self.buffer = None
        if buffer is not None:
            self._check_buffer(buffer)
            self.buffer = buffer

    def supports_async(self) -> bool:
        return True

    def _check_buffer(self, buffer) -> None:
        if buffer.group_size != self.world_size or buffer.rank != self.rank:
            raise ValueError(
                f"deep_ep.Buffer is for rank {buffer.rank} of {buffer.group_size}, but {self.name!r} runs "
                f"rank {self.rank} of {self.world_size}"
            )

    def _shared(self, hidden_size: int):
        raise NotImplementedError

    def ensure_buffer(self, hidden_size: int):
        """The Buffer this adapter uses, the process's shared one made now if needed (a
        collective: every rank must call it), e.g. before a graph capture."""
        if self.buffer is None:
            buffer = self._shared(hidden_size)
            self._check_buffer(buffer)
            self.buffer = buffer
        return self.buffer

    def _topk_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids.to(self._topk_idx_t).contiguous()

    def _modelled_bytes(self, count: Callable[[], int]) -> int | None:
        """Bytes for the modelled fabric: counting reads a device value on the host, so only
        when there is a fabric to model and no graph is being captured."""
        if self.fabric is None or graph_capture_active():
            return None
        return count()

    def _with_fabric(self, wait: RecvHook, nbytes: int | None) -> RecvHook:
        if nbytes is None:
            return timed_receive(wait)
        deadline = self.fabric.start(nbytes)

        def held_back() -> None:
            wait()
            FabricModel.wait_until(deadline)

        return timed_receive(held_back, self.fabric.transfer_time(nbytes))


def _row_bytes(hidden_size: int, use_fp8: bool) -> int:
    return int(hidden_size * (1 + 4 / 128)) if use_fp8 else hidden_size * DEEPEP_DTYPE.itemsize


class DeepEPLowLatencyPrepareAndFinalize(_DeepEPPrepareAndFinalize):
    """DeepEP low-latency kernels: fixed per-rank token budget, masked layout
    `[E_local, R*T, H]` + `recv_count`, receive hooks, top-k weights applied in combine."""

    activation_format = ActivationFormat.MASKED
    name = "deepep_low_latency"
    #: DeepEP flips its double-buffer index on the host at every low-latency call and each
    #: kernel cleans the other half for the next one: a step that stops between a dispatch
    #: and its combine leaves this rank's parity out of step with its peers and with the
    #: pointers baked into captured graphs. The engine stops instead of serving on.
    survives_failed_step = False
    #: fp8 dispatch can round the scales to powers of two and pack them as UE8M0
    #: (`round_scale=True, use_ue8m0=True`), what DeepGEMM reads on SM100.
    dispatches_ue8m0 = True
    dispatch_options = frozenset({"dispatch_max_tokens_per_rank", "fabric", "comm_sms"})

    @classmethod
    def default_dispatch_budget(cls, max_num_batched_tokens: int | None) -> int | None:
        """DeepEP's 128, the buffer vLLM sizes for: the buffer and queue pairs grow with it."""
        return DEFAULT_LL_MAX_TOKENS_PER_RANK

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, hidden_size: int) -> DeepEPLowLatencyPrepareAndFinalize:
        require_process_group(cls.name, config.group)
        budget = config.dispatch_max_tokens_per_rank
        return cls(
            num_experts,
            budget if budget is not None else cls.default_dispatch_budget(None),
            group=config.group,
            fabric=config.fabric,
            # The Buffer (a collective plus NVSHMEM init) is made now, at model build, not
            # inside the first (maybe ubatched) forward; the hidden size is checked here too.
            hidden_size=hidden_size,
        )

    def __init__(
        self,
        num_experts: int,
        max_tokens_per_rank: int = DEFAULT_LL_MAX_TOKENS_PER_RANK,
        group=None,
        buffer=None,
        fabric: FabricModel | None = None,
        hidden_size: int | None = None,
    ):
        super().__init__(num_experts, group, buffer, fabric)
        check_low_latency_budget(max_tokens_per_rank, self.world_size)
        self.max_tokens_per_rank = max_tokens_per_rank
        if hidden_size is not None:
            check_low_latency_hidden_size(hidden_size)
            if self.buffer is None:
                self.ensure_buffer(hidden_size)

    def _check_buffer(self, buffer) -> None:
        super()._check_buffer(buffer)
        if not buffer.low_latency_mode:
            raise ValueError(f"{self.name} needs a deep_ep.Buffer built with low_latency_mode=True")

    def _shared(self, hidden_size: int):
        check_low_latency_hidden_size(hidden_size)
        Buffer = self._deep_ep.Buffer
        num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
            self.max_tokens_per_rank, hidden_size, self.world_size, self.num_experts
        )

        def make():
            buffer = Buffer(
                self.group,
                num_nvl_bytes=0,
                num_rdma_bytes=num_rdma_bytes,
                low_latency_mode=True,
                num_qps_per_rank=self.num_local_experts,
            )
            return buffer, None

        return shared_buffer(
            self._deep_ep, self.group, low_latency=True, make=make, needs={"num_rdma_bytes": num_rdma_bytes}
        )

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"{num_tokens} tokens exceed {self.name}'s budget of {self.max_tokens_per_rank} tokens per rank "
                "(--deepep-ll-max-tokens-per-rank); raise it or use smaller steps"
            )
        buffer = self.ensure_buffer(hidden.shape[1])
        ids = self._topk_ids(topk_ids)
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            hidden.to(DEEPEP_DTYPE).contiguous(),
            ids,
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=use_fp8,
            round_scale=use_fp8 and ue8m0,
            use_ue8m0=use_fp8 and ue8m0,
            async_finish=False,
            return_recv_hook=True,
        )
        # On the wire the scales are float32 either way (UE8M0 packing happens on receive).
        nbytes = self._modelled_bytes(lambda: int((ids >= 0).sum()) * _row_bytes(hidden.shape[1], use_fp8))

        def receiver() -> ExpertTokens:
            x, scales = recv_x if use_fp8 else (recv_x, None)
            return ExpertTokens(x, scales, hidden.dtype, expert_num_tokens=recv_count, handle=handle)

        return self._with_fabric(hook, nbytes), receiver

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        ids = self._topk_ids(topk_ids)
        weights = topk_weights.to(torch.float32).contiguous()
        combined, _, hook = self.buffer.low_latency_combine(
            expert_output.to(DEEPEP_DTYPE).contiguous(),
            ids,
            weights,
            tokens.handle,
            async_finish=False,
            return_recv_hook=True,
        )
        nbytes = self._modelled_bytes(lambda: int((ids >= 0).sum()) * _row_bytes(expert_output.shape[-1], False))

        def receiver() -> torch.Tensor:
            # DeepEP's receive reads `ids` and `weights` (maybe copies made above) through raw
            # pointers when the hook has run, possibly a ubatch later: they live until here.
            _ = keep_alive
            return combined.to(tokens.dtype)

        keep_alive = (ids, weights)
        return self._with_fabric(hook, nbytes), receiver


class DeepEPHighThroughputPrepareAndFinalize(_DeepEPPrepareAndFinalize):
    """DeepEP high-throughput (normal) kernels: variable-size standard layout with local
    top-k ids (-1 for experts elsewhere), asynchronous events; combine sums the per-row
    partial outputs, which the experts already weighted."""

    activation_format = ActivationFormat.STANDARD
    name = "deepep_high_throughput"
    #: dispatch waits on the CPU for the peers' counts, which a captured graph never delivers.
    graph_capturable = False
    #: vLLM's order under DBO: yield, then the CPU-blocking dispatch/combine on the comm stream.
    yields_in_send = True
    dispatch_options = frozenset({"fabric", "comm_sms"})

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, hidden_size: int) -> DeepEPHighThroughputPrepareAndFinalize:
        require_process_group(cls.name, config.group)
        return cls(num_experts, group=config.group, fabric=config.fabric, hidden_size=hidden_size, comm_sms=config.comm_sms)

    def __init__(
        self,
        num_experts: int,
        group=None,
        buffer=None,
        fabric: FabricModel | None = None,
        hidden_size: int | None = None,
        comm_sms: int | None = None,
    ):
        super().__init__(num_experts, group, buffer, fabric)
        self.comm_sms = comm_sms
        if self.buffer is None and hidden_size is not None:
            self.ensure_buffer(hidden_size)

    def _shared(self, hidden_size: int):
        Buffer = self._deep_ep.Buffer
        # Size for the most SMs the kernels may get (`--comm-sms` raises Buffer.num_sms later):
        # the NVL buffer holds one chunk set per channel (two SMs).
        sms = max(Buffer.num_sms, self.comm_sms or 0)
        previous = Buffer.num_sms
        Buffer.set_num_sms(sms)
        try:
            configs = (Buffer.get_dispatch_config(self.world_size), Buffer.get_combine_config(self.world_size))
        finally:
            Buffer.set_num_sms(previous)
        hidden_bytes = hidden_size * DEEPEP_DTYPE.itemsize
        num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, self.world_size) for c in configs)
        num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, self.world_size) for c in configs)

        def make():
            buffer = Buffer(self.group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, num_qps_per_rank=1)
            return buffer, sms

        needs = {"num_nvl_bytes": num_nvl_bytes, "num_rdma_bytes": num_rdma_bytes}
        return shared_buffer(self._deep_ep, self.group, low_latency=False, make=make, needs=needs)

    def prepare_before_send(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        """SGLang's `dispatch_a`: the casts and this ubatch's compute event now; the layout and
        the dispatch, which holds the host until the peers' counts arrive, in the send."""
        buffer = self.ensure_buffer(hidden.shape[1])
        ids = self._topk_ids(topk_ids)
        weights = topk_weights.to(torch.float32).contiguous()
        payload = hidden.to(DEEPEP_DTYPE).contiguous()
        if use_fp8:
            q, scales = quantize_fp8_per_token_group(payload)
            payload = (q, scales.contiguous())
        # What the dispatch must wait for: this ubatch's compute, recorded before any yield (a
        # DBO one inside the send, a TBO stage's before it), so not the other ubatch's work
        # queued on the stream by the time the send runs.
        previous = buffer.capture()
        return lambda: self._send_dispatch(buffer, payload, ids, weights, previous, hidden, use_fp8)

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        return self.prepare_before_send(hidden, topk_weights, topk_ids, use_fp8=use_fp8, ue8m0=ue8m0)()

    def _send_dispatch(self, buffer, payload, ids, weights, previous, hidden, use_fp8):
        # Under DBO the dispatch blocks the CPU, so let the other ubatch queue its compute
        # first, and issue the transfer on the comm stream; synchronous there, asynchronous
        # (an event the receiver waits on) otherwise.
        under_dbo = dbo_enabled()
        dbo_yield_and_switch_from_compute_to_comm()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids, self.num_experts, previous_event=previous, async_finish=False, allocate_on_comm_stream=False
        )
        recv, recv_ids, recv_weights, _, handle, event = buffer.dispatch(
            payload,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=weights,
            previous_event=previous,
            async_finish=not under_dbo,
        )
        dbo_switch_to_compute_sync()
        nbytes = self._modelled_bytes(lambda: int(per_rank.sum()) * _row_bytes(hidden.shape[1], use_fp8))
        wait = self._with_fabric(_waiter(event), nbytes)

        def receiver() -> ExpertTokens:
            wait()
            x, scales = recv if use_fp8 else (recv, None)
            return ExpertTokens(x, scales, hidden.dtype, topk_ids=recv_ids, topk_weights=recv_weights, handle=handle)

        return None, receiver

    def finalize_before_send(self, expert_output, tokens, topk_weights, topk_ids):
        """The cast and this ubatch's compute event right after its experts; the combine in the
        send. Without the event DeepEP's combine waits for everything on the compute stream
        when it is issued: in TBO prefill, a stage later, the other ubatch's experts too."""
        buffer = self.buffer
        x = expert_output.to(DEEPEP_DTYPE).contiguous()
        previous = buffer.capture()
        return lambda: self._send_combine(buffer, x, tokens, previous)

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        return self.finalize_before_send(expert_output, tokens, topk_weights, topk_ids)()

    def _send_combine(self, buffer, x, tokens, previous):
        under_dbo = dbo_enabled()
        dbo_yield_and_switch_from_compute_to_comm()
        combined, _, event = buffer.combine(
            x, tokens.handle, previous_event=previous, async_finish=not under_dbo, allocate_on_comm_stream=False
        )
        dbo_switch_to_compute_sync()
        nbytes = self._modelled_bytes(lambda: x.shape[0] * x.shape[1] * x.element_size())
        wait = self._with_fabric(_waiter(event), nbytes)

        def receiver() -> torch.Tensor:
            wait()
            return combined.to(tokens.dtype)

        return None, receiver


def _waiter(event) -> RecvHook:
    """Wait for a DeepEP event; nothing to wait for when the call was synchronous."""
    if event.event is None:
        return lambda: None
    return event.current_stream_wait


# The budget checks and the shared-Buffer helpers are imported from here too (config,
# sm_partition, tests), as before they moved to deepep_buffers.
__all__ = [
    "DeepEPHighThroughputPrepareAndFinalize", "DeepEPLowLatencyPrepareAndFinalize", "check_low_latency_budget",
    "check_low_latency_hidden_size", "check_low_latency_step_budget", "ht_buffer_sms_limit", "import_deep_ep",
    "release_shared_buffers",
]  # fmt: skip
