"""Dispatch/combine over `torch.distributed.all_to_all_single` with exchanged split sizes.

On gloo every collective of the backend is issued by one issuer thread per process group,
in the order the ubatches submit them: the dispatch's split-size exchange is synchronous
and, on a real link, waits behind every byte already queued on the connection; on the
compute thread it stalled each ubatch until the other's transfer had drained, which is the
overlap DBO exists for. The compute thread now only prepares the payload and goes on; the
receive waits for the issuer's result.

Each token is sent once to every rank that holds at least one of its top-k experts, with
its top-k ids made local there (-1 for experts elsewhere) and its weights; experts return
one weighted partial sum per received row, and the source adds the partials up. Standard
activation format; asynchronous on gloo (CPU) and NCCL.

The combine can leave in blocks (SBO `combine-down-gemm`): block b carries chunk b of the
rows each source rank sent here, one `all_to_all_single` per block, so the first blocks
travel while the experts still compute the last ones.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from tandem.contexts.time_model import timed_blocking, timed_receive
from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import ActivationFormat, BlockCombine, ExpertTokens, PrepareAndFinalize
from tandem.modular_kernels.quant import FP8_DTYPE, quantize_fp8_per_token_group


def _async_a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    # fp8 has no collective support on gloo: move its bytes.
    if inp.dtype == FP8_DTYPE:
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


#: Bound on waiting for the issuer thread to hand over a transfer (the collective itself
#: has the process group's timeout).
ISSUE_TIMEOUT_S = 600.0


class _Issuer:
    """One daemon thread that runs submitted jobs in submission order. Every rank submits
    the same collectives in the same order (ubatches run one at a time), so the group sees
    one order on every rank; nothing else issues on the group while a forward's transfers
    are outstanding (each is received before the forward returns)."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the receiver, which raises it
                future.set_exception(exc)

    def submit(self, fn) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future


_ISSUERS: dict[object, _Issuer] = {}
_ISSUERS_LOCK = threading.Lock()


def _issuer_for(group) -> _Issuer:
    """The issuer of `group` (one per process group and process: every kernel on the group
    must share it, or two threads would interleave the group's collectives differently on
    different ranks)."""
    with _ISSUERS_LOCK:
        if group not in _ISSUERS:
            _ISSUERS[group] = _Issuer(f"tandem-a2a-issuer-{len(_ISSUERS)}")
        return _ISSUERS[group]


def _result(future: Future, what: str):
    try:
        return future.result(timeout=ISSUE_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"torch_a2a: the {what} was not issued within {ISSUE_TIMEOUT_S:.0f} s") from None


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class TorchAllToAllPrepareAndFinalize(PrepareAndFinalize):
    activation_format = ActivationFormat.STANDARD
    name = "torch_a2a"

    def __init__(self, num_experts: int, group=None, fabric: FabricModel | None = None, issue_thread: bool | None = None):
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self.fabric = fabric
        #: Issue from the group's issuer thread (default: on gloo, whose collectives are
        #: host work; NCCL ones are enqueued on the caller's stream, so they stay put).
        if issue_thread is None:
            issue_thread = dist.get_backend(group) == "gloo"
        self._issuer = _issuer_for(group) if issue_thread else None

    def supports_async(self) -> bool:
        return True

    def _active_issuer(self) -> _Issuer | None:
        # The sleep-timer fabric models a transfer from its issue time on the caller's
        # thread: it keeps the direct path.
        return self._issuer if self.fabric is None else None

    def _exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], out_splits, in_splits):
        """Issue the transfers (on the issuer thread if there is one); return the function
        that waits for them."""
        issue = lambda: [_async_a2a(r, s, out_splits, in_splits, self.group) for s, r in zip(sends, recvs)]  # noqa: E731
        issuer = self._active_issuer()
        if issuer is None:
            works = issue()
        else:
            issued_works = issuer.submit(issue)
        deadline = modelled = None
        if self.fabric is not None:
            issued = time.perf_counter()
            deadline = self.fabric.start(_nbytes(sends), _nbytes(recvs), issued=issued)
            modelled = deadline - issued

        def wait() -> None:
            for work in works if issuer is None else _result(issued_works, "transfer"):
                work.wait()
            if deadline is not None:
                FabricModel.wait_until(deadline)

        return timed_receive(wait, modelled)

    def prepare_async(self, hidden, topk_weights, topk_ids, *, use_fp8):
        local = self.num_local_experts
        dest = torch.where(topk_ids >= 0, topk_ids // local, -1)  # [T, K]
        # Row order: grouped by destination rank, by token inside a rank.
        sent_to = [(dest == r).any(dim=1).nonzero(as_tuple=True)[0] for r in range(self.world_size)]
        token_index = torch.cat(sent_to)
        rank_of_row = torch.cat([torch.full_like(idx, r) for r, idx in enumerate(sent_to)])
        send_counts = [int(idx.numel()) for idx in sent_to]
        row_ids = topk_ids[token_index]
        local_ids = torch.where(dest[token_index] == rank_of_row.unsqueeze(1), row_ids - rank_of_row.unsqueeze(1) * local, -1)
        payload, scales = hidden[token_index], None
        if use_fp8:
            payload, scales = quantize_fp8_per_token_group(payload)
        sends = [payload, local_ids, topk_weights[token_index].float()]
        if scales is not None:
            sends.append(scales)
        counts: dict = {}

        def exchange_counts() -> None:
            # On the data's device: the group may be NCCL, which takes no CPU tensors.
            recv_counts_t = torch.empty(self.world_size, dtype=torch.int64, device=hidden.device)
            send_counts_t = torch.tensor(send_counts, dtype=torch.int64).to(hidden.device)
            dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
            counts["recv"] = [int(n) for n in recv_counts_t.tolist()]

        def recv_buffers() -> list[torch.Tensor]:
            num_recv = sum(counts["recv"])
            k = topk_ids.shape[1]
            recvs = [
                hidden.new_empty((num_recv, hidden.shape[1]), dtype=payload.dtype),
                topk_ids.new_empty((num_recv, k)),
                torch.empty((num_recv, k), dtype=torch.float32, device=hidden.device),
            ]
            if scales is not None:
                recvs.append(torch.empty((num_recv, scales.shape[1]), dtype=torch.float32, device=hidden.device))
            return recvs

        landed: dict = {}
        if self._active_issuer() is None:
            with timed_blocking():
                exchange_counts()
            landed["recvs"] = recv_buffers()
            wait = self._exchange(sends, landed["recvs"], counts["recv"], send_counts)
        else:
            # The counts and the payload both leave from the issuer thread; the receive
            # waits for its buffers, then for the payload.
            def issue():
                exchange_counts()
                recvs = recv_buffers()
                return recvs, [_async_a2a(r, s_, counts["recv"], send_counts, self.group) for s_, r in zip(sends, recvs)]

            issued = self._issuer.submit(issue)

            def wait_payload() -> None:
                landed["recvs"], works = _result(issued, "dispatch")
                for work in works:
                    work.wait()

            wait = timed_receive(wait_payload)

        def receiver() -> ExpertTokens:
            wait()
            recvs, recv_counts = landed["recvs"], counts["recv"]
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
