"""`here`: the CPU host this runs on as a hardware profile, measured in the same run.

The rates are `tandem.bench.roofline`'s (the copy and read bandwidth, the matmul rate in
float32 on one thread, as each bench rank computes) plus what a step on this host pays
beyond them, each measured here:

- a short GEMM: one 32-row matmul on one warm weight prices the GEMM curve's small end, so a
  split batch's smaller GEMMs cost what they cost here;
- cold weights: the same matmul cycled over more distinct weights than the last-level cache
  holds against as many on one warm weight, on every rank at once as a step runs (`simulate.host_ranks`); its extra time per
  weight byte (`cold_weight_bytes_per_s`) is what every GEMM adds for reading its weights
  from memory, as a step does (each weight is read once a step, and the ubatches of a split
  step read it again);
- gloo's transfers (`simulate.host_link`, on the ranks of `simulate.host_ranks`): the runtime's dispatch and combine between real
  gloo ranks on this host at a few sizes, timed where the MoE stack's unsplit step issues them
  (back to back they cost a third to a half of that), a fixed cost per call plus a cost per byte;
- a model's routed experts (`simulate.host_experts`): tandem's fused CPU kernel, which the
  runtime runs a model's experts in, timed at a few token counts (weights read from memory);
- the non-GEMM ops (`simulate.host_elementwise`): lines for a float32 add, a tanh and the
  runtime's `select_experts`, each on a GEMM's fresh output, on every rank at once; the MoE
  stack's own ops, counted from its code, are priced on them.

Its ranks talk over gloo on the same host: a transfer is copies and TCP work done by the cores
that compute (`transfers_on_compute`), so overlapping a transfer with compute hides only
waiting on the peer, never the transfer's own work; the simulator then runs every mode with
transfers blocking compute, as `none` does. Joined by a shaped link instead (`--link-mbit`,
`simulate.shaped_link`), a transfer is that CPU part plus its bytes on the link, which is
waiting: the CPU part still holds compute, the wire part overlap can hide.
"""

from __future__ import annotations

import math

import torch

from tandem.bench.roofline import Roofline, measure_roofline
from tandem.simulate.hardware import HERE, HardwareProfile, load_hardware
from tandem.simulate.host_elementwise import ElementwiseFit, measure_elementwise
from tandem.simulate.host_gemm import (
    COLD_UNRESOLVED,
    SMALL_M,
    cold_weight_rate,
    last_level_cache_bytes,
    small_gemm_rate,
)
from tandem.simulate.host_experts import FusedExpertsFit, measure_fused_experts
from tandem.simulate.host_link import LinkFit
from tandem.simulate.host_ranks import measure_ranks


def measure_switch_s(executor: str = "thread", yields: int = 200) -> float:
    """Mean seconds of one hand-over between two ubatches on the runtime's `executor` (the
    executor's own switch clock, as the time model reads it)."""
    from tandem.contexts import dbo_yield, make_executor

    runner = make_executor(executor)

    def ubatch() -> None:
        for _ in range(yields):
            dbo_yield()

    try:
        runner.run([ubatch, ubatch])  # first run: the workers start
        before_s, before = runner.switch_time_s, runner.switches
        runner.run([ubatch, ubatch])
        return (runner.switch_time_s - before_s) / max(runner.switches - before, 1)
    finally:
        runner.close()


def gemm_m_half(big_m: int, small_m: int, rate_ratio: float) -> float:
    """The `gemm_m_half` of the simulator's efficiency curve m / (m + h) through two measured
    rates: rate(small_m) / rate(big_m) = `rate_ratio`. 0 when the small GEMM is as fast."""
    denominator = big_m * rate_ratio - small_m
    if rate_ratio >= 1.0 or denominator <= 0:
        return 0.0
    return big_m * small_m * (1.0 - rate_ratio) / denominator


def host_profile(
    ranks: int, *, executor: str = "thread", roofline: Roofline | None = None, small_rate: float | None = None,
    switch_s: float | None = None, cold_rate: float | None = None, link: LinkFit | None = None,
    elementwise: ElementwiseFit | None = None, experts: FusedExpertsFit | None = None,
) -> HardwareProfile:
    """This CPU with `ranks` gloo ranks on it, one intra-op thread each, its ubatches on the
    runtime's `executor`. `roofline`, `small_rate` (FLOP/s of the small GEMM), `switch_s` (one
    hand-over), `cold_rate` (bytes/s of a cold weight's read), `link` (gloo's dispatch and
    combine), `elementwise` (the non-GEMM ops' lines; `ElementwiseFit.unmeasured()`: none) and
    `experts` (the fused CPU experts kernel, `simulate.host_experts`; where tandem's CPU kernels
    are not built, or given `FusedExpertsFit.unmeasured()`: none) are measured here when not given."""
    if ranks < 1:
        raise ValueError(f"a host profile needs at least one rank, got {ranks}")
    if roofline is None:
        torch.set_num_threads(1)
        roofline = measure_roofline(torch.device("cpu"), torch.float32)
    size = roofline.matmul_size
    small_rate = small_rate if small_rate is not None else small_gemm_rate(size)
    switch_s = switch_s if switch_s is not None else measure_switch_s(executor)
    cold_rate, cold_how, link, elementwise = _measure_missing(ranks, size, cold_rate, link, elementwise, roofline)
    experts = experts if experts is not None else measure_fused_experts()
    half = gemm_m_half(size, SMALL_M, small_rate / roofline.matmul_flops_per_s)
    measured = f"measured in this run (tandem.bench.roofline, float32, one thread; {size}-wide matmul"
    flops, read = roofline.matmul_flops_per_s, roofline.read_bandwidth_bytes_per_s
    figures = {
        "sms": (1, "derived: one core per rank (each bench rank runs one intra-op thread); no core is set aside for transfers"),
        "hbm_bytes_per_s": (read, "measured in this run: tandem.bench.roofline's read bandwidth (a large sum)"),
        "hbm_efficiency": (1.0, "derived: the bandwidth is what this host achieved, not a datasheet peak"),
        "bf16_flops": (flops, f"{measured})"),
        "fp8_flops": (flops, f"{measured}; the CPU ranks compute in float32, there is no faster 8-bit path)"),
        "element_bytes": (4, "derived: the CPU ranks keep weights and activations in float32 (4 bytes), not fp8 or bf16"),
        "gemm_efficiency_max": (1.0 + half / size, f"derived: the {size}-wide matmul's rate is reached at m = {size}"),
        "gemm_m_half": (half, f"derived: efficiency m / (m + h) through the {size}-wide and a {SMALL_M}-row matmul measured in this run"),
        "cold_weight_bytes_per_s": (cold_rate, cold_how),
        "attention_prefill_efficiency": (1.0, "derived: the stand-in attention is matmuls at the measured rate"),
        "attention_decode_flops": (flops, f"{measured})"),
        "attention_decode_bytes_per_s": (read, "measured in this run: tandem.bench.roofline's read bandwidth"),
        "gpus_per_node": (ranks, "derived: every rank on this one host"),
        **_link_figures(link),
        "comm_sms_normal": (0, "derived: transfers take no core of their own (see transfers_on_compute)"),
        "comm_sms_low_latency": (0, "derived: transfers take no core of their own (see transfers_on_compute)"),
        **elementwise.figures(),
        **experts.figures(),
        "ubatch_switch_s": (switch_s, f"measured in this run: mean hand-over of two ubatches on the {executor} executor"),
        "transfers_on_compute": (
            True,
            "benchmarks/README.md (MoE layer stack, real gloo): gloo's transfers run on the cores that compute and "
            "take CPU from the ranks' compute; DBO measured 0.84-0.96x none there",
        ),
    }
    return HardwareProfile("here (CPU, gloo)", {k: v for k, (v, _) in figures.items()}, {k: s for k, (_, s) in figures.items()})


def _measure_missing(ranks: int, size: int, cold_rate: float | None, link: LinkFit | None,
                     elementwise: ElementwiseFit | None, roofline: Roofline):
    """(cold-weight rate, how it was had, gloo's line, the elementwise lines): what is not given
    measured on the gloo ranks, every rank at once as a step runs (one rank: in this process)."""
    cold_how = "given by the caller, not measured in this run"
    if ranks > 1 and (link is None or cold_rate is None):
        on_ranks = measure_ranks(ranks, matmul_size=size if cold_rate is None else 0, elementwise=elementwise is None)
        link, elementwise = link or on_ranks.link, elementwise or on_ranks.elementwise
        if cold_rate is None:
            cold_rate, cold_how = on_ranks.cold_rate, _cold_source(size, on_ranks.cycled, ranks, on_ranks.cold_rate)
    link = link or LinkFit.copies(roofline.bandwidth_bytes_per_s)
    if cold_rate is None:
        cold_rate, cycled = cold_weight_rate(size)
        cold_how = _cold_source(size, cycled, 1, cold_rate)
    return cold_rate, cold_how, link, elementwise or measure_elementwise()


def _cold_source(size: int, cycled: int, ranks: int, rate: float) -> str:
    who = "one process" if ranks == 1 else f"each of {ranks} gloo ranks at once (rank 0's figure)"
    unresolved = "" if math.isfinite(rate) else f"; {COLD_UNRESOLVED}"
    return (f"measured in this run by {who}: a {SMALL_M}-row x {size}-wide float32 matmul cycled over "
            f"{cycled / 2**20:.0f} MiB of distinct weights (more than the {last_level_cache_bytes() / 2**20:.0f} MiB "
            f"last-level cache), its time over the same matmul's on one warm weight, per weight byte: what a GEMM "
            f"adds reading its weights from memory{unresolved}")


def _link_figures(link: LinkFit) -> dict:
    if not any(link.points.values()):
        return {
            "nvlink_bytes_per_s": (link.bytes_per_s, "given by the caller (bytes at a copy's rate), not measured in this run"),
            "comm_latency_s": (link.fixed_s, "given by the caller (no cost per call), not measured in this run"),
        }
    how = ("measured in this run (simulate.host_link): the runtime's torch_a2a dispatch and combine between gloo ranks "
           "on this host, float32, each call timed where the MoE stack's unsplit step issues it, median time on rank 0 at "
           "a few sizes, a least-squares line through ")
    points = "; ".join(link.describe(kind) for kind in link.points)
    return {
        "nvlink_bytes_per_s": (link.bytes_per_s, f"{how}({points}): its slope, per byte sent per rank"),
        "comm_latency_s": (link.fixed_s, f"{how}({points}): its intercept, fixed per call"),
    }


def resolve_hardware(name: str, ranks: int) -> HardwareProfile:
    """A built-in profile or profile file, or `here` (this CPU with `ranks` gloo ranks, measured now)."""
    if name == HERE:
        return host_profile(ranks)
    return load_hardware(name)


__all__ = ["SMALL_M", "gemm_m_half", "host_profile", "measure_switch_s", "resolve_hardware"]
