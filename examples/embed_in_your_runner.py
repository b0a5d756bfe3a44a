"""Embedding tandem in your own model runner, end to end.

You have a Mixture-of-Experts model written in plain torch and a runner of your own. This
example keeps both and adds tandem in three steps:

1. swap each MoE layer's expert computation for a `FusedMoEModularKernel` made by
   `build_moe_kernel` (the model's own router stays; this rank keeps only its experts and
   tokens travel to them over an all-to-all);
2. wrap the model in `UBatchWrapper`;
3. per step, agree with the other ranks on the split (`coordinate_ubatching`), cut the
   batch (`split_by_tokens`) and run the wrapper under a `ForwardContext` carrying the
   slices: the two ubatches then take turns, each computing while the other's tokens are
   in flight (dual-batch overlap, DBO).

It starts 2 CPU ranks itself (gloo, loopback, a free port), runs one step per rank with
DBO and one without, compares both with the original model (every expert local, no
communication) and prints whether they match. `--trace FILE` also writes the step's
overlap timeline (Chrome trace-event JSON, open it in ui.perfetto.dev).

    python examples/embed_in_your_runner.py [--trace timeline.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import queue
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from tandem import ForwardContext, coordinate_ubatching, set_forward_context, split_by_tokens
from tandem.modular_kernels import build_moe_kernel
from tandem.worker.ubatch_wrapper import UBatchWrapper

VOCAB, HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K, NUM_LAYERS = 256, 64, 96, 8, 2, 2
WORLD_SIZE = 2
#: Tokens in each rank's batch: different on purpose, so the ranks must agree on padding.
TOKENS_PER_RANK = (24, 19)
TIMEOUT_S = 120.0


# -- 1. Your model, in plain torch (nothing from tandem) --------------------------------


def route(router: nn.Linear, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, weights renormalised: (weights [T, K] float32, ids [T, K] int64)."""
    weights, ids = torch.topk(torch.softmax(router(x).float(), dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class MoEMLP(nn.Module):
    """Routed experts; expert e is `(silu(x W1_gate[e]^T) * x W1_up[e]^T) W2[e]^T`."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        # Stacked per expert: w1 rows [:I] are the gate, [I:] the up projection.
        self.w1 = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) * hidden**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, intermediate) * intermediate**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router, x, self.top_k)
        out = torch.zeros_like(x)
        for expert in range(self.w1.shape[0]):
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = (x[rows] @ self.w1[expert].T).chunk(2, dim=-1)
            out.index_add_(0, rows, (F.silu(gate) * up) @ self.w2[expert].T * weights[rows, slot, None])
        return out


class Block(nn.Module):
    """A token mixer (a per-token MLP here: attention would need per-ubatch metadata, see
    the README) and an MoE layer, each behind a norm and a residual."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.mixer = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoEMLP(HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.moe(self.norm2(x))


class TinyMoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(token_ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# -- 2. The swap: the MoE layer's experts through tandem's kernel -----------------------


class ExpertParallelMoE(nn.Module):
    """Drop-in for `MoEMLP`: the same router, but only this rank's experts, run by a
    `FusedMoEModularKernel` that dispatches tokens to the ranks holding their experts and
    combines the results back (and yields to the other ubatch while they travel)."""

    def __init__(self, moe: MoEMLP, group: dist.ProcessGroup):
        super().__init__()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        num_experts = moe.w1.shape[0]
        local = num_experts // world
        self.top_k = moe.top_k
        self.router = moe.router
        # Rank r holds experts [r*E/R, (r+1)*E/R), the kernel's convention.
        self.w1 = nn.Parameter(moe.w1.detach()[rank * local : (rank + 1) * local].clone(), requires_grad=False)
        self.w2 = nn.Parameter(moe.w2.detach()[rank * local : (rank + 1) * local].clone(), requires_grad=False)
        self.kernel = build_moe_kernel(
            "torch_a2a", "torch", num_experts=num_experts, top_k=self.top_k, hidden_size=moe.w1.shape[2], group=group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router, x, self.top_k)  # global expert ids
        return self.kernel.forward(x, self.w1, self.w2, weights, ids)


def swap_in_tandem(model: TinyMoEModel, group: dist.ProcessGroup) -> TinyMoEModel:
    for block in model.blocks:
        block.moe = ExpertParallelMoE(block.moe, group)
    return model


# -- 3. Your runner's step --------------------------------------------------------------


def run_step(wrapper: UBatchWrapper, token_ids: torch.Tensor, *, dbo: bool, group) -> torch.Tensor:
    """One step of this rank's tokens. Every rank calls it together (the MoE layers'
    all-to-alls span all ranks), and all must agree on the split and on the padded size."""
    num_tokens = token_ids.shape[0]
    decision = coordinate_ubatching(num_tokens, dbo, group=group, num_ubatches=wrapper.num_ubatches)
    padded = decision.num_tokens_padded
    inputs = F.pad(token_ids, (0, padded - num_tokens))  # padding tokens: id 0, outputs dropped
    slices = None
    if decision.should_ubatch:
        # One token per request here (a decode step); pass your requests' query lengths.
        slices = split_by_tokens([1] * num_tokens, wrapper.num_ubatches, num_tokens_padded=padded)
    with set_forward_context(ForwardContext(ubatch_slices=slices)):
        return wrapper(inputs)[:num_tokens]


def rank_main(rank: int, port: int, trace_path: str | None, results) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S)
        )
        try:
            results.put((rank, run_rank(rank, trace_path)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def run_rank(rank: int, trace_path: str | None) -> dict:
    torch.manual_seed(0)  # every rank builds the same model
    torch.set_num_threads(1)
    reference_model = TinyMoEModel().eval()
    token_ids = torch.randint(0, VOCAB, (TOKENS_PER_RANK[rank],), generator=torch.Generator().manual_seed(rank))
    group = dist.group.WORLD
    wrapper = UBatchWrapper(swap_in_tandem(copy.deepcopy(reference_model), group), num_ubatches=2, executor="thread")

    tracer = None
    if trace_path is not None:  # optional: the overlap timeline of the DBO step
        from tandem.contexts import CommCounters, time_model
        from tandem.contexts.trace import Tracer

        tracer = Tracer(rank)

    with torch.no_grad():
        expected = reference_model(token_ids)
        plain = run_step(wrapper, token_ids, dbo=False, group=group)
        switches_before = wrapper.executor.switches
        if tracer is None:
            overlapped = run_step(wrapper, token_ids, dbo=True, group=group)
        else:
            import time

            start = time.perf_counter()
            with time_model(CommCounters(tracer=tracer)):
                overlapped = run_step(wrapper, token_ids, dbo=True, group=group)
            tracer.step(start, time.perf_counter(), mode="dbo", tokens=token_ids.shape[0])
    if tracer is not None:
        from tandem.contexts.trace import gather_trace, write_trace

        trace = gather_trace(tracer, group)
        if trace is not None:
            write_trace(trace_path, trace)
    return {
        "tokens": token_ids.shape[0],
        "dbo_max_diff": (overlapped - expected).abs().max().item(),
        "plain_max_diff": (plain - expected).abs().max().item(),
        "ubatch_switches": wrapper.executor.switches - switches_before,
        "ubatched_runs": wrapper.ubatched_runs,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", metavar="FILE", help="write the DBO step's overlap timeline (Chrome trace JSON)")
    parser.add_argument("--atol", type=float, default=1e-5, help="largest |difference| that counts as a match")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, args.trace, results), daemon=True) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    outcomes: dict[int, object] = {}
    try:
        while len(outcomes) < WORLD_SIZE:
            try:
                rank, outcome = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                print(f"error: ranks {sorted(set(range(WORLD_SIZE)) - set(outcomes))} gave no result in {TIMEOUT_S:g} s")
                return 2
            outcomes[rank] = outcome
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = {r: o for r, o in outcomes.items() if isinstance(o, str)}
    if failed:
        for r, tb in failed.items():
            print(f"rank {r} failed:\n{tb}", file=sys.stderr)
        return 2
    ok = True
    for rank in range(WORLD_SIZE):
        o = outcomes[rank]
        match = o["dbo_max_diff"] <= args.atol and o["plain_max_diff"] <= args.atol and o["ubatch_switches"] > 0
        ok &= match
        print(
            f"rank {rank}: {o['tokens']} tokens, DBO step: {o['ubatch_switches']} ubatch switches, "
            f"max |DBO - original| = {o['dbo_max_diff']:.2e}, max |no DBO - original| = {o['plain_max_diff']:.2e}"
        )
    if args.trace:
        print(f"overlap timeline: {args.trace} (open in ui.perfetto.dev)")
    print(f"result: {'match' if ok else 'MISMATCH'} (tolerance {args.atol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
