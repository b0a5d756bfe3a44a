"""`--hardware here` over a shaped link: the ranks' transfers cross a rate-limited wire.

`benchmarks/real_links.py` joins its two hosts by a veth whose ends carry a `tbf` qdisc. A
transfer there is two parts:

- its CPU part: gloo's copies and TCP work on the cores that compute, what the host profile's
  loopback line measures (`host_link`; `OpCosts.transfer` prices it). It stays on the compute
  stream in every mode: overlap cannot hide it;
- its wire part: the bytes that leave the rank over the link's rate. That is waiting: it runs
  on the comm stream, so `none` waits for it and an overlapped mode can hide it. Its packets
  still cost the cores something as they trickle through (per packet, where an unshaped link
  moves large segments): with a measured `compute_rate` < 1, compute runs at that share of its
  core while a transfer is on the wire (`schedule.play`'s overlap rate). The other way round,
  the transfer's own threads (gloo's, the kernel's TCP work) share the core with compute: with a
  measured `wire_rate` < 1 the wire keeps that share of its pace while compute runs.

`run.simulate_mode` plays a send on such a profile as `schedule.play`'s kernel-then-transfer:
the CPU part on the compute stream, then the wire part on the comm stream.

What crosses the wire: each token once to every other rank holding one of its top-k experts
(the runtime's `torch_a2a`), so a transfer's bytes per rank (`OpCosts.transfer_bytes`, which
counts the rank's own copy too) times (ep - 1) / ep under uniform routing. The seconds per such
byte are either nominal (`ShapedLink.nominal`: tbf counts whole frames, so 1514 bytes on the
wire per 1448 of TCP payload at MTU 1500, at the set rate) or the link's measured behaviour
(`ShapedLink.calibrated`: the seconds per byte a `none` step paid at a few probe rates, joined
in log-log, and beyond them scaled by (probe / rate) ** exponent).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tandem.simulate.hardware import HardwareProfile

#: TCP payload and wire bytes of one full frame at MTU 1500: IP 20 + TCP 32 (with timestamps,
#: Linux's default) bytes of headers in the MTU, 14 of Ethernet header around it; tbf charges
#: the frame as the qdisc sees it (the Ethernet header included, no preamble or FCS on a veth).
FRAME_PAYLOAD_BYTES, FRAME_WIRE_BYTES = 1448, 1514
#: The profile's figure for a shaped link: seconds on the wire per payload byte leaving a rank.
LINK_FIGURE = "link_seconds_per_byte"
RATE_FIGURE = "link_rate_mbit"
#: The share of its core compute keeps while a transfer is on the wire (1: none taken).
COMPUTE_RATE_FIGURE = "link_compute_rate"
#: The least of its core compute keeps under packet work: softirq work that runs long is handed to
#: ksoftirqd, a normal thread the scheduler shares the core with fairly (Linux, kernel/softirq.c:
#: MAX_SOFTIRQ_TIME 2 ms, MAX_SOFTIRQ_RESTART 10), so a faster link slows the wire, not compute.
FAIR_SHARE = 0.5
#: The share of its pace the wire keeps while compute runs (1: compute takes none).
WIRE_RATE_FIGURE = "link_wire_rate"


def _check_rate(name: str, mbit: float) -> float:
    value = float(mbit)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of Mbit/s, got {mbit!r}")
    return value


@dataclass(frozen=True)
class ShapedLink:
    """A link at `rate_mbit` (tbf's rate: bits per second of whole frames) and the seconds a
    payload byte takes on it; `source` says where that figure comes from."""

    rate_mbit: float
    seconds_per_byte: float
    source: str
    #: The share of its core compute keeps while a transfer is on the wire, and where that comes from.
    compute_rate: float = 1.0
    compute_rate_source: str = "derived: a transfer on the wire takes no CPU from compute (not measured)"
    #: The share of its pace the wire keeps while compute runs, and where that comes from.
    wire_rate: float = 1.0
    wire_rate_source: str = "derived: compute takes nothing from the wire (not measured)"

    def __post_init__(self) -> None:
        for name, value in (("compute rate under a transfer", self.compute_rate), ("wire rate under compute", self.wire_rate)):
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ValueError(f"the {name} must be in (0, 1], got {value!r}")

    @classmethod
    def nominal(cls, rate_mbit: float) -> ShapedLink:
        """The set rate, every TCP payload byte carrying its frame's headers."""
        rate = _check_rate("the link rate", rate_mbit)
        overhead = FRAME_WIRE_BYTES / FRAME_PAYLOAD_BYTES
        return cls(rate, 8.0 * overhead / (rate * 1e6), (
            f"derived: tbf's {rate:g} Mbit/s counts whole frames: {FRAME_WIRE_BYTES} bytes on the wire per "
            f"{FRAME_PAYLOAD_BYTES} of TCP payload at MTU 1500 (Ethernet 14, IP 20, TCP 32 with timestamps); "
            "tbf's burst and TCP's own pacing are not modelled"))

    @classmethod
    def calibrated(cls, rate_mbit: float, *, probes: list[tuple[float, float]], exponent: float, how: str) -> ShapedLink:
        """The link's measured behaviour: `probes`, (Mbit/s, seconds per byte) measured at a few
        rates, joined in log-log (time ~ rate ** -slope between neighbouring probes: tbf's queue
        and TCP's backing off make a shaped link not linear in 1 / rate); beyond the probes, the
        nearest one scaled as time ~ rate ** -`exponent`. `how` says how they were measured."""
        rate = _check_rate("the link rate", rate_mbit)
        if not probes:
            raise ValueError("a calibrated link needs at least one probe")
        by_rate: dict[float, list[float]] = {}
        for mbit, seconds_per_byte in probes:
            if not (math.isfinite(seconds_per_byte) and seconds_per_byte > 0):
                raise ValueError(f"a probe's seconds per byte must be positive, got {seconds_per_byte!r}")
            by_rate.setdefault(_check_rate("the probe rate", mbit), []).append(seconds_per_byte)
        # Two probes at one rate (rows clamped to the same rate) are one point: their mean.
        table = {mbit: sum(values) / len(values) for mbit, values in by_rate.items()}
        if not (math.isfinite(exponent) and exponent > 0):
            raise ValueError(f"the rate exponent must be positive, got {exponent!r}")
        seconds, said = _through_probes(rate, sorted(table.items()), exponent)
        nominal = cls.nominal(rate).seconds_per_byte
        return cls(rate, seconds, f"measured in this run: {how}; {said} = {seconds / nominal:.3f}x the nominal frame rate")

    def with_cpu_per_byte(self, cpu_seconds_per_byte: float, how: str) -> ShapedLink:
        """This link with its packets' CPU: `cpu_seconds_per_byte` of a core per byte on the wire,
        spread over the transfer, so compute keeps 1 - cpu / seconds_per_byte of its core while a
        transfer is in flight, never less than `FAIR_SHARE`."""
        if not (math.isfinite(cpu_seconds_per_byte) and cpu_seconds_per_byte >= 0):
            raise ValueError(f"the CPU per byte must be >= 0, got {cpu_seconds_per_byte!r}")
        rate = max(1.0 - cpu_seconds_per_byte / self.seconds_per_byte, FAIR_SHARE)
        source = (f"measured in this run: {how}; {cpu_seconds_per_byte * 1e9:.2f} ns of a core per byte on the wire, "
                  f"over {self.seconds_per_byte * 1e9:.2f} ns per byte at {self.rate_mbit:g} Mbit/s")
        return dataclasses.replace(self, compute_rate=rate, compute_rate_source=source)

    def with_wire_rate(self, wire_rate: float, how: str) -> ShapedLink:
        """This link with the wire keeping `wire_rate` of its pace while compute runs (the
        transfer's threads sharing the core with it), measured as `how` says."""
        return dataclasses.replace(self, wire_rate=wire_rate, wire_rate_source=f"measured in this run: {how}")

    def figures(self) -> dict[str, tuple[float, str]]:
        return {
            RATE_FIGURE: (self.rate_mbit, "given: the tbf rate the link is set to"),
            LINK_FIGURE: (self.seconds_per_byte, self.source),
            COMPUTE_RATE_FIGURE: (self.compute_rate, self.compute_rate_source),
            WIRE_RATE_FIGURE: (self.wire_rate, self.wire_rate_source),
        }


def _through_probes(rate: float, table: list[tuple[float, float]], exponent: float) -> tuple[float, str]:
    """(seconds per byte at `rate`, how it was had) from the ascending (Mbit/s, seconds per byte)
    `table`: the probe itself, log-log between the two around it, or the nearest end scaled by
    `exponent`."""
    ns = lambda v: f"{v * 1e9:.2f} ns per byte"  # noqa: E731
    for mbit, seconds in table:
        if math.isclose(mbit, rate, rel_tol=1e-6):
            return seconds, f"{ns(seconds)} at its own {mbit:g} Mbit/s probe"
    if rate < table[0][0] or rate > table[-1][0]:
        mbit, seconds = table[0] if rate < table[0][0] else table[-1]
        scaled = seconds * (mbit / rate) ** exponent
        return scaled, f"{ns(seconds)} at {mbit:g} Mbit/s, x ({mbit:g} / {rate:g}) ** {exponent:.3f}"
    (lo, lo_s), (hi, hi_s) = next((a, b) for a, b in zip(table, table[1:]) if a[0] < rate < b[0])
    slope = math.log(lo_s / hi_s) / math.log(hi / lo)
    seconds = lo_s * (lo / rate) ** slope
    return seconds, f"between the {lo:g} and {hi:g} Mbit/s probes ({ns(lo_s)}, {ns(hi_s)}: time ~ rate ** -{slope:.3f})"


def over_link(hw: HardwareProfile, link: ShapedLink) -> HardwareProfile:
    """`hw` (a host whose cores do the transfers: `--hardware here`) with its ranks joined by
    `link`: each transfer's CPU part as `hw` measured it, plus its wire part on `link`."""
    if not hw.transfers_on_compute:
        raise ValueError(f"a shaped link is modelled on a host whose cores move the transfers (--hardware here), "
                         f"not on {hw.name}: its transfer figures are already a fabric's")
    figures, sources = dict(hw.figures), dict(hw.sources)
    for key, (value, source) in link.figures().items():
        figures[key], sources[key] = value, source
    name = hw.name.split(" over ")[0]
    return HardwareProfile(f"{name} over a {link.rate_mbit:g} Mbit/s link", figures, sources)


def link_seconds_per_byte(hw: HardwareProfile) -> float | None:
    """The profile's wire time per payload byte, or None on a profile with no shaped link."""
    value = hw.figures.get(LINK_FIGURE)
    return None if value is None else float(value)


def link_compute_rate(hw: HardwareProfile) -> float:
    """The share of its core compute keeps while a transfer is on the profile's link (1 without one)."""
    return float(hw.figures.get(COMPUTE_RATE_FIGURE, 1.0))


def link_wire_rate(hw: HardwareProfile) -> float:
    """The share of its pace the wire keeps while compute runs (1 without a measured one)."""
    return float(hw.figures.get(WIRE_RATE_FIGURE, 1.0))


def overlap_rate_over_link(hw: HardwareProfile):
    """`schedule.play`'s overlap rate on the profile's link: a compute op keeps
    `link_compute_rate` of its core while a transfer is on the wire, a transfer keeps
    `link_wire_rate` of its pace while compute runs; None where both keep all of it."""
    from tandem.simulate.ops import SENDS

    rate, wire = link_compute_rate(hw), link_wire_rate(hw)
    if rate >= 1.0 and wire >= 1.0:
        return None
    return lambda u, step: wire if step.name in SENDS else rate


def wire_share(ep: int) -> float:
    """The share of a transfer's per-rank bytes that leaves the rank: uniform routing sends a
    token's copies to each of `ep` ranks alike, and the rank's own copy stays."""
    return (ep - 1) / ep if ep > 1 else 0.0


__all__ = ["COMPUTE_RATE_FIGURE", "FRAME_PAYLOAD_BYTES", "FRAME_WIRE_BYTES", "LINK_FIGURE", "WIRE_RATE_FIGURE", "ShapedLink",
           "link_compute_rate", "link_seconds_per_byte", "link_wire_rate", "over_link", "overlap_rate_over_link",
           "wire_share"]
