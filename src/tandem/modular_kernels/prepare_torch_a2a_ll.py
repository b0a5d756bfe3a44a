"""Low-latency dispatch/combine on torch.distributed: DeepEP low-latency semantics with
static shapes.

Every rank may send at most `max_tokens_per_rank` (T) tokens. The send buffer is always
`[R, E_local, T, H]` (slot p of expert e on rank r), so every transfer has the same shape
whatever the routing, and a graph capture can record it. The receiving rank packs what
arrived into the masked layout `[E_local, R*T, H]`, expert e's rows first, with
`expert_num_tokens[e]` of them valid. Built on functional collectives (dispatcher ops),
which a `TorchDispatchMode` trace records and a replay re-issues.

The combine can leave one local expert at a time (SBO `combine-down-gemm`): expert e's
rows `[R, T, H]` go out as soon as its down projection is done.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tandem.contexts.time_model import timed_receive
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import ActivationFormat, BlockCombine, ExpertTokens, PrepareAndFinalize, require_process_group
from tandem.modular_kernels.quant import FP8_DTYPE, quantize_fp8_per_token_group


class TorchLowLatencyPrepareAndFinalize(PrepareAndFinalize):
    activation_format = ActivationFormat.MASKED
    name = "torch_a2a_ll"

    dispatch_options = frozenset({"dispatch_max_tokens_per_rank", "fabric"})

    @classmethod
    def default_dispatch_budget(cls, max_num_batched_tokens: int | None) -> int | None:
        """A whole step's tokens: a dispatch then never overflows the buffer."""
        return max_num_batched_tokens

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, hidden_size: int) -> TorchLowLatencyPrepareAndFinalize:
        require_process_group(cls.name, config.group)
        return cls(num_experts, config.dispatch_max_tokens_per_rank, group=config.group, fabric=config.fabric)

    def __init__(self, num_experts: int, max_tokens_per_rank: int, group=None, fabric: FabricModel | None = None):
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        if max_tokens_per_rank is None or max_tokens_per_rank < 1:
            raise ValueError(f"torch_a2a_ll needs max_tokens_per_rank >= 1, got {max_tokens_per_rank}")
        self.max_tokens_per_rank = max_tokens_per_rank
        self.group = group if group is not None else dist.group.WORLD
        self.fabric = fabric

    def supports_async(self) -> bool:
        return True

    def _exchange(self, tensors: list[torch.Tensor]):
        """Issue an equal-split all-to-all of each `[R, ...]` tensor; return the function
        that waits for them and the list it fills with the received tensors."""
        world = self.world_size
        issued = []
        for t in tensors:
            flat = t.reshape(world, -1)
            as_bytes = flat.dtype == FP8_DTYPE
            if as_bytes:
                flat = flat.view(torch.uint8)
            split = [flat.shape[1]] * world
            issued.append((funcol.all_to_all_single(flat.reshape(-1), split, split, self.group), t, as_bytes))
        deadline = modelled = None
        if self.fabric is not None:
            # Equal splits: this rank receives as many bytes as it sends.
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            issued = time.perf_counter()
            deadline = self.fabric.start(nbytes, nbytes, issued=issued)
            modelled = deadline - issued
        received: list[torch.Tensor] = []

        def wait() -> None:
            for out, like, as_bytes in issued:
                out = funcol.wait_tensor(out)
                if as_bytes:
                    out = out.view(FP8_DTYPE)
                received.append(out.view(like.shape))
            if deadline is not None:
                FabricModel.wait_until(deadline)

        return timed_receive(wait, modelled), received

    def _slots(self, topk_ids: torch.Tensor):
        """For every (token, k): destination rank, local expert and slot within that
        expert's T rows from this rank; invalid pairs point past the buffer."""
        num_tokens = topk_ids.shape[0]
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"{num_tokens} tokens exceed torch_a2a_ll's max_tokens_per_rank={self.max_tokens_per_rank}"
            )
        local, T = self.num_local_experts, self.max_tokens_per_rank
        valid = topk_ids >= 0
        ids = topk_ids.clamp(min=0)
        # Not F.one_hot: on CPU it checks its ids on the host, which a graph capture refuses.
        experts = torch.arange(self.num_experts, device=ids.device)
        onehot = ((ids.flatten().unsqueeze(1) == experts) & valid.flatten().unsqueeze(1)).long()
        slot = ((onehot.cumsum(0) - onehot) * onehot).sum(1).view_as(ids)
        flat_slot = torch.where(valid, ids * T + slot, self.num_experts * T)  # = ((r*local)+e)*T + p
        counts = onehot.sum(0).view(self.world_size, local)
        return valid, flat_slot, counts

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        world, local, T = self.world_size, self.num_local_experts, self.max_tokens_per_rank
        H = hidden.shape[1]
        valid, flat_slot, send_counts = self._slots(topk_ids)
        payload, scales = hidden, None
        if use_fp8:
            payload, scales = quantize_fp8_per_token_group(hidden)
        K = topk_ids.shape[1]
        rows = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(K)

        def scatter(values: torch.Tensor) -> torch.Tensor:
            buf = values.new_zeros((self.num_experts * T + 1, values.shape[1]))
            buf[flat_slot.flatten()] = values[rows]  # invalid pairs land on the spare last row
            return buf[:-1].view(world, local, T, values.shape[1])

        sends = [send_counts, scatter(payload)]
        if scales is not None:
            sends.append(scatter(scales))
        wait, received = self._exchange(sends)

        def receiver() -> ExpertTokens:
            wait()
            recv_counts = received[0]  # [R(src), E_local]
            offsets = recv_counts.cumsum(0) - recv_counts  # where src r's rows start in expert e
            p = torch.arange(T, device=recv_counts.device)
            dest = offsets.unsqueeze(-1) + p  # [R, E_local, T]
            keep = p < recv_counts.unsqueeze(-1)
            experts = torch.arange(local, device=recv_counts.device).view(1, local, 1)
            packed_index = torch.where(keep, experts * (world * T) + dest, local * world * T)

            def pack(x: torch.Tensor) -> torch.Tensor:
                buf = x.new_zeros((local * world * T + 1, x.shape[-1]))
                buf[packed_index.flatten()] = x.reshape(-1, x.shape[-1])
                return buf[:-1].view(local, world * T, x.shape[-1])

            return ExpertTokens(
                pack(received[1]),
                pack(received[2]) if scales is not None else None,
                hidden.dtype,
                expert_num_tokens=recv_counts.sum(0),
                handle=(valid, flat_slot, packed_index, H),
            )

        return None, receiver

    def supports_block_combine(self) -> bool:
        return True

    def finalize_in_blocks(self, tokens, topk_weights, topk_ids, *, num_sms=None):
        return _ExpertBlockCombine(self, tokens, topk_weights, topk_ids, self.num_local_experts)

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        combine = _ExpertBlockCombine(self, tokens, topk_weights, topk_ids, 1)
        combine.send(0, expert_output)
        return combine.finish()


class _ExpertBlockCombine(BlockCombine):
    """Block i = a run of local experts; each block's rows go back to their source ranks
    in one equal-split all-to-all of `[R, experts in block, T, H]`."""

    def __init__(self, pf: TorchLowLatencyPrepareAndFinalize, tokens: ExpertTokens, topk_weights, topk_ids, num_blocks: int):
        self._pf = pf
        self._valid, self._flat_slot, self._packed_index, self._H = tokens.handle
        self._topk_weights, self._topk_ids = topk_weights, topk_ids
        bounds = [pf.num_local_experts * i // num_blocks for i in range(num_blocks + 1)]
        self.blocks = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        self._in_flight: list = []

    def send(self, index: int, output: torch.Tensor) -> None:
        if index != len(self._in_flight):
            raise RuntimeError(f"combine blocks go in order: expected block {len(self._in_flight)}, got {index}")
        pf, H, block = self._pf, self._H, self.blocks[index]
        rows_per_expert = pf.world_size * pf.max_tokens_per_rank
        n = block.stop - block.start
        index_in_block = self._packed_index[:, block] - block.start * rows_per_expert
        # The packed index marks empty slots past every expert's rows; point them at the spare zero row.
        index_in_block = torch.where(self._packed_index[:, block] >= pf.num_local_experts * rows_per_expert, n * rows_per_expert, index_in_block)
        padded = torch.cat([output.reshape(-1, H), output.new_zeros((1, H))])
        back = padded[index_in_block.flatten()].view(pf.world_size, n, pf.max_tokens_per_rank, H)  # per source rank
        self._in_flight.append(pf._exchange([back]) + (output.dtype,))

    def finish(self):
        if len(self._in_flight) != len(self.blocks):
            raise RuntimeError(f"{len(self._in_flight)} of {len(self.blocks)} combine blocks were sent")
        in_flight, H = self._in_flight, self._H
        flat_slot, valid, topk_weights, topk_ids = self._flat_slot, self._valid, self._topk_weights, self._topk_ids

        def receiver() -> torch.Tensor:
            for wait, _, _ in in_flight:
                wait()
            blocks = [got[0] for _, got, _ in in_flight]
            received = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)  # [R, E_local, T, H]
            rows = torch.cat([received.reshape(-1, H), received.new_zeros((1, H))])
            per_pair = rows[flat_slot.flatten()].view(*topk_ids.shape, H).float()
            weights = (topk_weights.float() * valid).unsqueeze(-1)
            return (per_pair * weights).sum(1).to(in_flight[0][2])

        return None, receiver
