"""`simulate(...)`: one step of a model on a cluster, under each overlap mode.

The workload is one step per rank: prefill (`tokens_per_rank` tokens of prompts of
`context` tokens, causal attention) or decode (`tokens_per_rank` requests, one token each,
attending to `context` cached tokens; with `draft_tokens` d each request runs 1 + d tokens, as
MTP verification does, reads its cache once, and yields 1 + d x `acceptance` tokens). Every rank does the same (balanced routing, as in
DeepSeek's published profile), so one rank's timeline is the cluster's.

Modes: `none` (transfers complete before the next op: compute + comm in sequence), `dboN`
(`dbo` = `dbo2`: the step cut into N ubatches by `tandem.ubatch.split_by_tokens`, run in the
order of the runtime's stages with the kernel's DBO hand-overs), `tbo` (the layers'
operation lists and `delta_stages`, leading dense layers on the whole batch), and
`sbo-dispatch-shared` / `sbo-combine-shared` (one batch, the shared experts in the transfer's
window) and `sbo-combine-down-gemm` (one batch, the down projection in one block per local
expert, each block's combine sent as it is done, the shared experts in the dispatch window:
`simulate.block_combine`; refused where the profile's transfers are DeepEP's, as the runtime
refuses it there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from tandem.modular_kernels.sbo import COMBINE_DOWN_GEMM
from tandem.simulate import block_combine
from tandem.simulate.hardware import HardwareProfile
from tandem.simulate.host import resolve_hardware
from tandem.simulate.host_loop import SchedulerLoops, host_step_seconds, scheduler_loops
from tandem.simulate.model_shape import ModelShape, model_shape
from tandem.simulate.ops import SENDS, Layout, OpCosts, UBatchWork
from tandem.simulate.schedule import Span, Step, issue_order, layer_steps, play, tbo_program
from tandem.simulate.shaped_link import ShapedLink, link_seconds_per_byte, over_link, overlap_rate_over_link, wire_share
from tandem.ubatch import split_by_tokens

SBO_MODES = {"sbo-dispatch-shared": "dispatch-shared", "sbo-combine-shared": "combine-shared", block_combine.MODE: COMBINE_DOWN_GEMM}
HEAD = Step(-1, "head")


@dataclass(frozen=True)
class Workload:
    phase: str  # "prefill" or "decode"
    tokens_per_rank: int
    context: int
    draft_tokens: int = 0  # decode: tokens per request beyond the first (MTP's draft)
    acceptance: float = 0.0  # decode: share of the draft tokens kept

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be prefill or decode, got {self.phase!r}")
        if self.tokens_per_rank < 1 or self.context < 1:
            raise ValueError("tokens per rank and context must be >= 1")
        if self.draft_tokens < 0 or not 0.0 <= self.acceptance <= 1.0:
            raise ValueError("draft tokens must be >= 0 and acceptance in [0, 1]")
        if self.draft_tokens and not self.decode:
            raise ValueError("draft tokens are a decode setting")

    @property
    def decode(self) -> bool:
        return self.phase == "decode"

    @property
    def output_tokens(self) -> float:
        """Tokens a step yields: prefill's prompt tokens, decode's 1 + kept drafts per request."""
        if not self.decode:
            return self.tokens_per_rank
        return self.tokens_per_rank * (1.0 + self.draft_tokens * self.acceptance)

    def request_lengths(self) -> list[int]:
        if self.decode:
            return [1 + self.draft_tokens] * self.tokens_per_rank
        full, rest = divmod(self.tokens_per_rank, self.context)
        return [self.context] * full + ([rest] if rest else [])

    def split(self, n: int) -> list[UBatchWork]:
        """Each ubatch's work, cut where `tandem.ubatch.split_by_tokens` cuts."""
        lengths = self.request_lengths()
        starts = [sum(lengths[:r]) for r in range(len(lengths))]
        out = []
        for sl in split_by_tokens(lengths, n):
            lo, hi = sl.token_slice.start, sl.token_slice.stop
            attended = requests = 0
            for start, length in zip(starts, lengths):
                a, b = max(lo, start) - start, min(hi, start + length) - start
                if b <= a:
                    continue
                requests += 1
                # Prefill: query p attends to p + 1 keys; decode: each query attends to the context.
                attended += self.context * (b - a) if self.decode else (b * (b + 1) - a * (a + 1)) // 2
            # Decode reads each request's cache once, however many of its queries attend to it.
            out.append(UBatchWork(hi - lo, requests, attended, requests * self.context if self.decode else attended))
        return out


@dataclass
class ModeResult:
    mode: str
    step_s: float
    tokens: float
    compute_s: float
    comm_s: float
    spans: list[Span] = field(repr=False)
    #: The step under the normal and the overlapped scheduler loop (with a host figure only).
    loops: SchedulerLoops | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def floor_s(self) -> float:
        return max(self.compute_s, self.comm_s)


@dataclass
class Simulation:
    model: ModelShape
    hardware: HardwareProfile
    layout: Layout
    workload: Workload
    results: list[ModeResult]
    #: The engine's CPU work a step outside the forward (`simulate.host_loop`); None: not given.
    host_step_s: float | None = None

    def speedup(self, result: ModeResult) -> float | None:
        base = next((r for r in self.results if r.mode == "none"), None)
        return None if base is None else base.step_s / result.step_s


def _ubatches(mode: str) -> int:
    match = re.fullmatch(r"dbo(\d*)", mode)
    if match is None:
        raise ValueError(f"unknown mode {mode!r}; modes: none, dbo, dboN, tbo, {', '.join(SBO_MODES)}")
    n = int(match[1] or 2)
    if n < 1:
        raise ValueError(f"{mode}: needs at least 1 ubatch")
    return n


def _program(mode: str, shape: ModelShape, workload: Workload, ep_works: list[UBatchWork], yields_in_send: bool = False,
             blocks: int = 1):
    """(issue order, works per ubatch, overlapped?) of a mode; `yields_in_send`: the backend
    hands the host to the other ubatch inside its sends (DeepEP's normal kernels under DBO);
    `blocks`: combine-down-gemm's blocks per layer."""
    if mode == "none" or mode in SBO_MODES:
        steps = layer_steps(shape, dbo=False, sbo_mode=SBO_MODES.get(mode), blocks=blocks) + [HEAD]
        return issue_order([steps], [0]), ep_works, mode != "none"
    if mode == "tbo":
        prefix, steps, delta = tbo_program(shape, workload.decode, yields_in_send=yields_in_send)
        works = workload.split(2)
        whole = [(0, s) for s in prefix]
        order = [(u + 1, s) for u, s in issue_order([steps, steps], [0, delta])]
        # ubatch 0 is the whole batch (leading dense layers, the head); 1.. are the split ones.
        return whole + order + [(0, HEAD)], ep_works + works, True
    n = _ubatches(mode)
    steps = layer_steps(shape, dbo=n > 1, yields_in_send=yields_in_send) + [HEAD]
    works = workload.split(n)
    return issue_order([steps] * n, [0] * n), works, n > 1


def simulate_mode(mode: str, shape: ModelShape, hw: HardwareProfile, layout: Layout, workload: Workload) -> ModeResult:
    whole = workload.split(1)
    alone = OpCosts(shape, hw, layout)
    # DeepEP's normal kernels under DBO yield inside their sends, then join the compute stream to
    # the transfer they issued (`dbo_switch_to_compute_sync`): compute issued after a send waits
    # for it, as none's does; what the other ubatch queued during the yield runs beside it.
    holds_host = alone.backend().yields_in_send
    joins = holds_host and mode.startswith("dbo") and _ubatches(mode) > 1
    blocks = 1
    if mode == block_combine.MODE:
        block_combine.refuse_without_block_combine(alone.backend(), hw.name)
        blocks = block_combine.block_count(alone)
    # TBO's operation list issues such a send after its stage's yield (the dispatch's two steps).
    order, works, overlapped = _program(mode, shape, workload, whole, yields_in_send=joins or (holds_host and mode == "tbo"),
                                        blocks=blocks)
    share = 1.0
    if overlapped:
        share = (hw.sms - hw.comm_sms(layout.low_latency)) / hw.sms
    # Alone: all SMs, a transfer at its table bandwidth. Overlapped: compute at the SMs a normal
    # DeepEP transfer leaves, a transfer at the bandwidth it keeps; `play` applies each only
    # while the other stream is busy.
    shared = OpCosts(shape, hw, layout, sm_share=share, overlapped=True) if overlapped else alone

    def moved_work(u: int, step: Step) -> UBatchWork:
        """The work a step moves: a combine block's share, else its ubatch's."""
        return block_combine.block_work(works[u], blocks) if step.name == block_combine.COMBINE_BLOCK else works[u]

    def priced(costs: OpCosts, u: int, step: Step) -> float:
        if step.name in SENDS:
            return costs.transfer(SENDS[step.name], moved_work(u, step))
        if step.name in block_combine.COMPUTE_STEPS:
            return block_combine.block_compute(costs, step.name, works[u], blocks)
        return costs.compute(step.name, works[u])

    def overlap_rate(u: int, step: Step) -> float:
        by_itself, overlapped_time = priced(alone, u, step), priced(shared, u, step)
        return by_itself / overlapped_time if overlapped_time > by_itself > 0 else 1.0

    wire = link_seconds_per_byte(hw)
    # On a host whose cores do the transfers (gloo on a CPU) a transfer holds compute in every
    # mode; over a shaped link only its CPU part does, and its wire part can be overlapped.
    sync = not overlapped or (hw.transfers_on_compute and wire is None)
    costs = shared if sync else alone
    if wire is None:
        cost = lambda u, step: priced(costs, u, step)  # noqa: E731
        kernel = lambda u, step: costs.send_kernel(SENDS[step.name], moved_work(u, step))  # noqa: E731
        rate = None if sync else overlap_rate
    else:
        cost, kernel = _over_link(costs, moved_work, wire, priced)
        rate = None if sync else overlap_rate_over_link(hw)
    spans = play(order, cost, sync_comm=sync or joins, switch_s=float(hw.figures.get("ubatch_switch_s", 0.0)),
                 kernel=kernel, overlap_rate=rate, host_wait=lambda u, step: costs.host_wait(SENDS[step.name], moved_work(u, step)))
    end = max(s.end for s in spans)
    compute = sum(s.end - s.start for s in spans if s.lane == "compute")
    comm = sum(s.end - s.start for s in spans if s.lane == "comm")
    return ModeResult(mode, end, workload.output_tokens, compute, comm, spans)


def _over_link(costs: OpCosts, work: Callable[[int, Step], UBatchWork], seconds_per_byte: float, priced):
    """(cost, kernel) of `play` over a shaped link: a send's CPU part (the host's measured
    transfer line) is its kernel on the compute stream, its bytes leaving the rank at the link's
    seconds per byte the transfer on the comm stream (`simulate.shaped_link`); `work(u, step)`: the
    work a step moves."""
    share = wire_share(costs.layout.ep)

    def cost(u: int, step: Step) -> float:
        if step.name in SENDS:
            return costs.transfer_bytes(SENDS[step.name], work(u, step)) * share * seconds_per_byte
        return priced(costs, u, step)

    return cost, lambda u, step: priced(costs, u, step)


def simulate(
    model: str | dict = "deepseek-v3",
    hardware: str | HardwareProfile = "h800",
    *,
    ep: int = 32,
    phase: str = "prefill",
    tokens_per_rank: int = 4096,
    context: int = 4096,
    modes: tuple[str, ...] | list[str] = ("none", "dbo", "tbo"),
    low_latency: bool | None = None,
    draft_tokens: int = 0,
    acceptance: float = 0.0,
    link_mbit: float | None = None,
    host_step_ms: float | None = None,
) -> Simulation:
    """Simulate one step per mode. `hardware` is a profile, a profile name or file, or `here`
    (this CPU with `ep` gloo ranks, measured now). `low_latency` (DeepEP's low-latency kernels)
    defaults to the decode phase, as DeepSeek deploys them; prefill uses the normal kernels, and
    so does a host whose cores do the transfers (gloo has no low-latency path). `draft_tokens`
    and `acceptance`: MTP in decode (see `Workload`). `link_mbit`: the ranks joined by a link
    shaped to that rate (`simulate.shaped_link`, nominal; only on a host whose cores move the
    transfers, as `here`). `host_step_ms`: the engine's CPU work a step outside the forward;
    with it each result's `loops` holds its step under the normal and the overlapped scheduler
    loop (`simulate.host_loop`)."""
    host_s = None if host_step_ms is None else host_step_seconds(host_step_ms)  # refused before any measurement
    shape = model_shape(model)
    workload = Workload(phase, tokens_per_rank, context, draft_tokens, acceptance)
    link = None if link_mbit is None else ShapedLink.nominal(link_mbit)  # a bad rate fails before any measurement
    hw = hardware if isinstance(hardware, HardwareProfile) else resolve_hardware(hardware, ep)
    if link is not None:
        hw = over_link(hw, link)
    gloo = hw.transfers_on_compute
    if low_latency and gloo:
        raise ValueError(f"{hw.name} moves its transfers with gloo: DeepEP's low-latency kernels are not modelled there")
    low_latency = (workload.decode and not gloo) if low_latency is None else low_latency
    layout = Layout(ep=ep, decode=workload.decode, low_latency=low_latency)
    results = [simulate_mode(m.strip(), shape, hw, layout, workload) for m in modes if m.strip()]
    if host_s is not None:
        for r in results:
            r.loops = scheduler_loops(r.step_s, r.tokens, host_s, hw)
    return Simulation(shape, hw, layout, workload, results, host_s)


__all__ = ["ModeResult", "SBO_MODES", "Simulation", "Workload", "simulate", "simulate_mode"]
