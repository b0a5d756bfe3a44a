"""Dispatch/combine over `torch.distributed.all_to_all_single` with exchanged split sizes.

Each token is sent once to every rank that holds at least one of its top-k experts, with
its top-k ids made local there (-1 for experts elsewhere) and its weights; experts return
one weighted partial sum per received row, and the source adds the partials up. Standard
activation format; asynchronous on gloo (CPU) and NCCL.

The combine can leave in blocks (SBO `combine-down-gemm`): block b carries chunk b of the
rows each source rank sent here, one `all_to_all_single` per block, so the first blocks
travel while the experts still compute the last ones.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tandem.contexts.time_model import timed_blocking, timed_receive
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import ActivationFormat, BlockCombine, ExpertTokens, PrepareAndFinalize, require_process_group
from tandem.modular_kernels.quant import FP8_DTYPE, quantize_fp8_per_token_group


def _async_a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    # fp8 has no collective support on gloo: move its bytes.
    if inp.dtype == FP8_DTYPE:
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class TorchAllToAllPrepareAndFinalize(PrepareAndFinalize):
    activation_format = ActivationFormat.STANDARD
    name = "torch_a2a"
    #: the counts exchange is read on the host (`.tolist()`) and rows are picked with `nonzero`.
    graph_capturable = False

    dispatch_options = frozenset({"fabric"})

    def __init__(self, num_experts: int, group=None, fabric: FabricModel | None = None):
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self.fabric = fabric

    @classmethod
    def from_moe_config(cls, config, *, num_experts: int, hidden_size: int) -> TorchAllToAllPrepareAndFinalize:
        require_process_group(cls.name, config.group)
        return cls(num_experts, group=config.group, fabric=config.fabric)

    def supports_async(self) -> bool:
        return True

    def _exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], out_splits, in_splits):
        """Issue the transfers; return the function that waits for them."""
        works = [_async_a2a(r, s, out_splits, in_splits, self.group) for s, r in zip(sends, recvs)]
        deadline = modelled = None
        if self.fabric is not None:
            issued = time.perf_counter()
            deadline = self.fabric.start(_nbytes(sends), _nbytes(recvs), issued=issued)
            modelled = deadline - issued

        def wait() -> None:
            for work in works:
                work.wait()
            if deadline is not None:
                FabricModel.wait_until(deadline)

        return timed_receive(wait, modelled)

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8, ue8m0=False):
        local = self.num_local_experts
        dest = torch.where(topk_ids >= 0, topk_ids // local, -1)  # [T, K]
        # Row order: grouped by destination rank, by token inside a rank.
        sent_to = [(dest == r).any(dim=1).nonzero(as_tuple=True)[0] for r in range(self.world_size)]
        token_index = torch.cat(sent_to)
        rank_of_row = torch.cat([torch.full_like(idx, r) for r, idx in enumerate(sent_to)])
        send_counts = [int(idx.numel()) for idx in sent_to]
        # On the data's device: the group may be NCCL, which takes no CPU tensors.
        recv_counts_t = torch.empty(self.world_size, dtype=torch.int64, device=hidden.device)
        send_counts_t = torch.tensor(send_counts, dtype=torch.int64).to(hidden.device)
        with timed_blocking():
            dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        recv_counts = [int(n) for n in recv_counts_t.tolist()]
        num_recv = sum(recv_counts)

        row_ids = topk_ids[token_index]
        local_ids = torch.where(dest[token_index] == rank_of_row.unsqueeze(1), row_ids - rank_of_row.unsqueeze(1) * local, -1)
        payload, scales = hidden[token_index], None
        if use_fp8:
            payload, scales = quantize_fp8_per_token_group(payload)
        sends = [payload, local_ids, topk_weights[token_index].float()]
        recvs = [
            hidden.new_empty((num_recv, hidden.shape[1]), dtype=payload.dtype),
            topk_ids.new_empty((num_recv, topk_ids.shape[1])),
            torch.empty((num_recv, topk_ids.shape[1]), dtype=torch.float32, device=hidden.device),
        ]
        if scales is not None:
            sends.append(scales)
            recvs.append(torch.empty((num_recv, scales.shape[1]), dtype=torch.float32, device=hidden.device))
        wait = self._exchange(sends, recvs, recv_counts, send_counts)

        def receiver() -> ExpertTokens:
            wait()
            return ExpertTokens(
                recvs[0],
                recvs[3] if scales is not None else None,
                hidden.dtype,
                topk_ids=recvs[1],
                topk_weights=recvs[2],
                handle=(token_index, send_counts, recv_counts, hidden.shape[0]),
            )

        return None, receiver

    def supports_block_combine(self) -> bool:
        return True

    def finalize_in_blocks(self, tokens, topk_weights, topk_ids, *, num_sms=None):
        # One block per local expert's worth of rows: as many as the masked backends send.
        return _RowBlockCombine(self, tokens, self.num_local_experts)

    def finalize_async(self, expert_output, tokens, topk_weights, topk_ids):
        combine = _RowBlockCombine(self, tokens, 1)
        combine.send(0, expert_output)
        return combine.finish()


def _chunk_sizes(n: int, num_chunks: int) -> list[int]:
    """`num_chunks` consecutive near-equal chunks of `n` rows, larger ones first: the rank
    that sends rows and the rank that gets them back cut them the same way."""
    base, extra = divmod(n, num_chunks)
    return [base + (i < extra) for i in range(num_chunks)]


def _block_rows(counts: list[int], chunks: list[list[int]], block: int, device) -> torch.Tensor:
    """Indices of block `block`'s rows in a buffer grouped by rank (`counts[r]` rows each):
    chunk `block` of every rank's group."""
    starts, offset = [], 0
    for count, sizes in zip(counts, chunks):
        lo = offset + sum(sizes[:block])
        starts.append(torch.arange(lo, lo + sizes[block], device=device))
        offset += count
    return torch.cat(starts)


class _RowBlockCombine(BlockCombine):
    def __init__(self, pf: TorchAllToAllPrepareAndFinalize, tokens: ExpertTokens, num_blocks: int):
        self._pf = pf
        self._token_index, send_counts, recv_counts, self._num_tokens = tokens.handle
        device = tokens.hidden.device
        recv_chunks = [_chunk_sizes(n, num_blocks) for n in recv_counts]
        send_chunks = [_chunk_sizes(n, num_blocks) for n in send_counts]
        self._recv_splits = [[c[b] for c in recv_chunks] for b in range(num_blocks)]
        self._send_splits = [[c[b] for c in send_chunks] for b in range(num_blocks)]
        if num_blocks == 1:
            self.blocks = [torch.arange(sum(recv_counts), device=device)]
            self._origin = [self._token_index]
        else:
            self.blocks = [_block_rows(recv_counts, recv_chunks, b, device) for b in range(num_blocks)]
            self._origin = [self._token_index[_block_rows(send_counts, send_chunks, b, device)] for b in range(num_blocks)]
        self._in_flight: list = []

    def send(self, index: int, output: torch.Tensor) -> None:
        if index != len(self._in_flight):
            raise RuntimeError(f"combine blocks go in order: expected block {len(self._in_flight)}, got {index}")
        back = output.new_empty((len(self._origin[index]), output.shape[1]))
        wait = self._pf._exchange([output.contiguous()], [back], self._send_splits[index], self._recv_splits[index])
        self._in_flight.append((back, wait))

    def finish(self):
        if len(self._in_flight) != len(self.blocks):
            raise RuntimeError(f"{len(self._in_flight)} of {len(self.blocks)} combine blocks were sent")
        in_flight, origin = self._in_flight, self._origin
        num_tokens, dtype = self._num_tokens, in_flight[0][0].dtype

        def receiver() -> torch.Tensor:
            out = torch.zeros((num_tokens, in_flight[0][0].shape[1]), dtype=torch.float32, device=in_flight[0][0].device)
            for (back, wait), rows in zip(in_flight, origin):
                wait()
                out.index_add_(0, rows, back.float())
            return out.to(dtype)

        return None, receiver
