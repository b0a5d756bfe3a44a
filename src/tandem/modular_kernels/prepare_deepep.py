"""Dispatch/combine over DeepEP (`deep_ep.Buffer`): low-latency (masked layout, receive
hooks) and high-throughput (standard layout, events).

DeepEP is imported lazily when an adapter is built; without it the constructor raises an
ImportError that says how to get it. Both adapters take an existing `deep_ep.Buffer` or
build one from the process group with DeepEP's own size hints, on first use (the hidden
size is known then) or at construction when `hidden_size` is given. A Buffer can be shared
by several adapters (e.g. every MoE layer of a model) as long as they run one at a time.

Under DBO each ubatch has its own Buffer (made on its first use; every rank runs the same
ubatches in the same order, so the collective set-up matches): DeepEP's low-latency mode
double-buffers at most two operations in flight, and N ubatches may have N.

On CPU, `tandem.testing.fake_deep_ep.install()` puts an emulation of DeepEP's API in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.contexts import dbo_current_ubatch_id
from tandem.contexts.time_model import timed_receive
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import ActivationFormat, ExpertTokens, PrepareAndFinalize, RecvHook
from tandem.modular_kernels.quant import quantize_fp8_per_token_group

_HOW_TO_GET_DEEPEP = (
    "DeepEP is not on PyPI: build and install it from its own source "
    "(https://github.com/deepseek-ai/DeepEP) against your CUDA toolkit and NVSHMEM, as the README's "
    "GPU extras section says; CPU tests use tandem.testing.fake_deep_ep.install() instead"
)


def import_deep_ep(backend: str):
    """`import deep_ep`, or an ImportError naming the backend and how to get DeepEP."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ImportError(
            f"the {backend!r} all2all backend needs DeepEP (`import deep_ep` failed: {exc}). {_HOW_TO_GET_DEEPEP}"
        ) from exc
    return deep_ep


class _DeepEPPrepareAndFinalize(PrepareAndFinalize):
    def __init__(self, num_experts: int, group=None, buffer=None, fabric: FabricModel | None = None):
        self._deep_ep = import_deep_ep(self.name)
        if group is None:
            if not dist.is_initialized():
                raise ValueError(f"all2all backend {self.name!r} needs an initialised torch.distributed process group")
            group = dist.group.WORLD
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self.fabric = fabric
        self._buffers: dict[int, object] = {}
        if buffer is not None:
            self._check_buffer(buffer)
            self._buffers[0] = buffer

    @property
    def buffer(self):
        """The calling ubatch's Buffer (ubatch 0's outside DBO), or None before first use."""
        return self._buffers.get(dbo_current_ubatch_id())

    def supports_async(self) -> bool:
        return True

    def _check_buffer(self, buffer) -> None:
        if buffer.group_size != self.world_size or buffer.rank != self.rank:
            raise ValueError(
                f"deep_ep.Buffer is for rank {buffer.rank} of {buffer.group_size}, but {self.name!r} runs "
                f"rank {self.rank} of {self.world_size}"
            )

    def _make_buffer(self, hidden_size: int, dtype: torch.dtype):
        raise NotImplementedError

    def ensure_buffer(self, hidden_size: int, dtype: torch.dtype = torch.bfloat16):
        """Build the calling ubatch's Buffer now (a collective: every rank must call it),
        e.g. before a graph capture; returns it. A no-op when that ubatch already has one."""
        ubatch = dbo_current_ubatch_id()
        if ubatch not in self._buffers:
            buffer = self._make_buffer(hidden_size, dtype)
            self._check_buffer(buffer)
            self._buffers[ubatch] = buffer
        return self._buffers[ubatch]

    def _with_fabric(self, hook: RecvHook, nbytes: int) -> RecvHook:
        if self.fabric is None:
            return timed_receive(hook)
        deadline = self.fabric.start(nbytes)

        def held_back() -> None:
            hook()
            FabricModel.wait_until(deadline)

        return timed_receive(held_back, self.fabric.transfer_time(nbytes))


class DeepEPLowLatencyPrepareAndFinalize(_DeepEPPrepareAndFinalize):
    """DeepEP low-latency kernels: fixed per-rank token budget, masked layout
    `[E_local, R*T, H]` + `recv_count`, receive hooks, top-k weights applied in combine."""

    activation_format = ActivationFormat.MASKED
    name = "deepep_low_latency"

    def __init__(
        self,
        num_experts: int,
        max_tokens_per_rank: int,
        group=None,
        buffer=None,
        fabric: FabricModel | None = None,
        hidden_size: int | None = None,
    ):
        if max_tokens_per_rank is None or max_tokens_per_rank < 1:
            raise ValueError(f"{self.name} needs max_tokens_per_rank >= 1, got {max_tokens_per_rank}")
        self.max_tokens_per_rank = max_tokens_per_rank
        super().__init__(num_experts, group, buffer, fabric)
        if self.buffer is None and hidden_size is not None:
            self.ensure_buffer(hidden_size)

    def _check_buffer(self, buffer) -> None:
        super()._check_buffer(buffer)
        if not buffer.low_latency_mode:
            raise ValueError(f"{self.name} needs a deep_ep.Buffer built with low_latency_mode=True")

    def _make_buffer(self, hidden_size: int, dtype: torch.dtype):
        Buffer = self._deep_ep.Buffer
        num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
            self.max_tokens_per_rank, hidden_size, self.world_size, self.num_experts
        )
        return Buffer(
            self.group,
            num_nvl_bytes=0,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=self.num_local_experts,
        )

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8):
        num_tokens = hidden.shape[0]
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"{num_tokens} tokens exceed {self.name}'s max_tokens_per_rank={self.max_tokens_per_rank}"
            )
        buffer = self.ensure_buffer(hidden.shape[1], hidden.dtype)
        topk_ids = topk_ids.to(torch.int64).contiguous()
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            hidden.contiguous(),
            topk_ids,
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=use_fp8,
            async_finish=False,
            return_recv_hook=True,
        )
        row_bytes = hidden.shape[1] * (1 + 4 / 128 if use_fp8 else hidden.element_size())
        nbytes = int((topk_ids >= 0).sum()) * int(row_bytes)

        def receiver() -> ExpertTokens:
            x, scales = recv_x if use_fp8 else (recv_x, None)
            return ExpertTokens(x, scales, hidden.dtype, expert_num_tokens=recv_count, handle=handle)

        return self._with_fabric(hook, nbytes), receiver

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        topk_ids = topk_ids.to(torch.int64).contiguous()
        combined, _, hook = self.buffer.low_latency_combine(
            expert_output.contiguous(),
            topk_ids,
            topk_weights.to(torch.float32).contiguous(),
            tokens.handle,
            async_finish=False,
            return_recv_hook=True,
        )
        nbytes = int((topk_ids >= 0).sum()) * expert_output.shape[-1] * expert_output.element_size()
        return self._with_fabric(hook, nbytes), lambda: combined


class DeepEPHighThroughputPrepareAndFinalize(_DeepEPPrepareAndFinalize):
    """DeepEP high-throughput (normal) kernels: variable-size standard layout with local
    top-k ids (-1 for experts elsewhere), asynchronous events; combine sums the per-row
    partial outputs, which the experts already weighted."""

    activation_format = ActivationFormat.STANDARD
    name = "deepep_high_throughput"

    def __init__(
        self,
        num_experts: int,
        group=None,
        buffer=None,
        fabric: FabricModel | None = None,
        hidden_size: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(num_experts, group, buffer, fabric)
        if self.buffer is None and hidden_size is not None:
            self.ensure_buffer(hidden_size, dtype)

    def _make_buffer(self, hidden_size: int, dtype: torch.dtype):
        Buffer = self._deep_ep.Buffer
        hidden_bytes = hidden_size * max(torch.empty((), dtype=dtype).element_size(), 2)
        configs = (Buffer.get_dispatch_config(self.world_size), Buffer.get_combine_config(self.world_size))
        num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, self.world_size) for c in configs)
        num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, self.world_size) for c in configs)
        return Buffer(self.group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, num_qps_per_rank=1)

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8):
        buffer = self.ensure_buffer(hidden.shape[1], hidden.dtype)
        topk_ids = topk_ids.to(torch.int64).contiguous()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_ids, self.num_experts)
        payload = hidden.contiguous()
        if use_fp8:
            q, scales = quantize_fp8_per_token_group(payload)
            payload = (q, scales.contiguous())
        recv, recv_ids, recv_weights, _, handle, event = buffer.dispatch(
            payload,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_ids,
            topk_weights=topk_weights.to(torch.float32).contiguous(),
            async_finish=True,
        )
        row_bytes = hidden.shape[1] * (1 + 4 / 128 if use_fp8 else hidden.element_size())
        nbytes = int(per_rank.sum()) * int(row_bytes)

        def receiver() -> ExpertTokens:
            x, scales = recv if use_fp8 else (recv, None)
            return ExpertTokens(
                x, scales, hidden.dtype, topk_ids=recv_ids, topk_weights=recv_weights, handle=handle
            )

        return self._with_fabric(event.current_stream_wait, nbytes), receiver

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        combined, _, event = self.buffer.combine(expert_output.contiguous(), tokens.handle, async_finish=True)
        nbytes = expert_output.shape[0] * expert_output.shape[-1] * expert_output.element_size()
        return self._with_fabric(event.current_stream_wait, nbytes), lambda: combined
