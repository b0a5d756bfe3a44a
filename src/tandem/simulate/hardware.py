"""Hardware profiles (`hardware/*.json`, shipped in the package) and the time of one op on them.

A profile is a set of figures, each `{"value": ..., "source": ...}`: a vendor sheet, DeepEP's
or DeepGEMM's or FlashMLA's published table, or `derived: ...` saying how a figure that is not
public was derived. `HardwareProfile` reads them; its methods turn FLOPs and bytes into
seconds (roofline: the larger of FLOPs over the achieved rate and bytes over the achieved HBM
bandwidth) and transfer bytes into seconds (bytes over DeepEP's achieved bandwidth on the
bottleneck link of the EP layout).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

PROFILES = ("h800", "h100", "h200", "b200")
#: The hardware name of the host this runs on (`tandem.simulate.host.resolve_hardware` measures it).
HERE = "here"


def _profile_text(name: str) -> str:
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path.read_text(encoding="utf-8")
    key = name.lower()
    if key not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; built-in profiles: {', '.join(PROFILES)}, a profile .json file, "
                         f"or {HERE!r} (this host, measured now)")
    return resources.files("tandem.simulate").joinpath("hardware", f"{key}.json").read_text(encoding="utf-8")


def _value_from(profile: str, key: str) -> Any:
    """A figure another built-in profile publishes (`"value_from": "h800"`): one copy of a
    table several GPUs share, so a correction reaches all of them."""
    figure = json.loads(_profile_text(profile))["figures"].get(key)
    if not isinstance(figure, dict) or "value" not in figure:
        raise ValueError(f"hardware profile {profile!r} has no literal value for figure {key!r} to take")
    return figure["value"]


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU kind and its interconnect, as the simulator uses it."""

    name: str
    figures: dict[str, Any]
    sources: dict[str, str] = field(repr=False)

    @classmethod
    def load(cls, name: str) -> "HardwareProfile":
        data = json.loads(_profile_text(name))
        figures, sources = {}, {}
        for key, figure in data["figures"].items():
            has_value = isinstance(figure, dict) and ("value" in figure or "value_from" in figure)
            if not has_value or not str(figure.get("source", "")).strip():
                raise ValueError(f"hardware profile {data.get('name', name)}: figure {key!r} needs a value and a source")
            figures[key] = figure["value"] if "value" in figure else _value_from(figure["value_from"], key)
            sources[key] = figure["source"]
        return cls(str(data["name"]), figures, sources)

    @property
    def transfers_on_compute(self) -> bool:
        """The ranks' own cores move the transfers (gloo on a CPU host): a transfer holds
        compute in every mode, and there are no low-latency kernels."""
        return bool(self.figures.get("transfers_on_compute", False))

    def __getattr__(self, key: str) -> Any:
        figures = self.__dict__.get("figures", {})
        if key in figures:
            return figures[key]
        raise AttributeError(key)

    # -- compute -----------------------------------------------------------------------

    def gemm_efficiency(self, m: float) -> float:
        """The achieved fraction of the tensor-core peak of a GEMM with `m` rows (a
        saturating curve fitted to DeepGEMM's published rows; see `gemm_anchors`)."""
        m = max(float(m), 1.0)
        return self.gemm_efficiency_max * m / (m + self.gemm_m_half)

    def hbm_rate(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_efficiency

    def gemm_time(self, m: float, n: int, k: int, *, groups: int = 1, fp8: bool = True, sm_share: float = 1.0) -> float:
        """`groups` GEMMs of [m, k] x [k, n]: weights and activations read once, output written."""
        if m <= 0:
            return 0.0
        peak = (self.fp8_flops if fp8 else self.bf16_flops) * sm_share
        flops = 2.0 * m * n * k * groups
        # A profile that computes in one dtype throughout (a CPU host: float32) names its width.
        element = self.figures.get("element_bytes")
        width, out_width = (element, element) if element else (1 if fp8 else 2, 2)
        bytes_ = groups * (n * k * width + m * k * width + m * n * out_width)
        rate = self.gemm_table_rate(m, n, k) if fp8 and not element else None
        rate = peak * self.gemm_efficiency(m) if rate is None else rate * sm_share
        return max(flops / rate, bytes_ / self.hbm_rate()) + self.cold_weight_time(groups * n * k * width)

    def gemm_table_rate(self, m: float, n: int, k: int) -> float | None:
        """The published FP8 rate (FLOP/s) of a GEMM of this [k, n] weight at `m` rows per group,
        where the profile's `gemm_table` has rows for that weight (DeepGEMM's README: DeepSeek's
        own shapes), each at this profile's HBM (`_table_row_rate`): linear in log m between its
        rows, the first row's time below it, the last row's rate above it. None for a weight the
        table lacks (the fitted curve prices it)."""
        points: dict[int, list[float]] = {}
        for row in self.figures.get("gemm_table", ()):
            if (row["n"], row["k"]) == (n, k):
                points.setdefault(row["m"], []).append(self._table_row_rate(row))
        if not points:
            return None
        ms = sorted(points)
        rates = [sum(points[x]) / len(points[x]) for x in ms]
        if m <= ms[0]:
            return rates[0] * m / ms[0]
        if m >= ms[-1]:
            return rates[-1]
        i = next(j for j in range(1, len(ms)) if m <= ms[j])
        t = math.log(m / ms[i - 1]) / math.log(ms[i] / ms[i - 1])
        return rates[i - 1] + t * (rates[i] - rates[i - 1])

    def _table_row_rate(self, row: dict[str, float]) -> float:
        """One `gemm_table` row's rate on this profile. The rows are measurements on a GPU with
        `gemm_table_hbm_bytes_per_s` of HBM (H800's, for DeepGEMM's tables); on the same tensor
        cores with other HBM, the part of a row's time that its bytes take beyond its compute
        floor (the FLOPs at the curve's best rate) is taken at this profile's HBM instead: a
        compute-bound row carries as published, a memory-bound one moves with the bandwidth."""
        m, n, k, groups = row["m"], row["n"], row["k"], row.get("groups", 1)
        flops, rate = 2.0 * m * n * k * groups, row["tflops"] * 1e12
        measured_on = float(self.figures.get("gemm_table_hbm_bytes_per_s", self.hbm_bytes_per_s))
        if measured_on == self.hbm_bytes_per_s:
            return rate
        bytes_ = groups * (n * k + m * k + m * n * 2)
        floor = flops / (self.fp8_flops * self.gemm_efficiency_max)
        excess_there = max(0.0, bytes_ / (measured_on * self.hbm_efficiency) - floor)
        excess_here = max(0.0, bytes_ / self.hbm_rate() - floor)
        return flops / (flops / rate - excess_there + excess_here)

    def cold_weight_time(self, weight_bytes: float) -> float:
        """What a GEMM adds for reading weights that are not in cache (a profile's measured
        `cold_weight_bytes_per_s`; a CPU host streams every weight from memory once a step,
        on top of the arithmetic). None in a profile without the figure (the GPUs: the HBM
        roofline already covers the weights)."""
        rate = self.figures.get("cold_weight_bytes_per_s")
        return weight_bytes / rate if rate else 0.0

    def memory_time(self, bytes_: float) -> float:
        return bytes_ / self.hbm_rate()

    def prefill_attention_time(self, flops: float, sm_share: float = 1.0) -> float:
        return flops / (self.bf16_flops * self.attention_prefill_efficiency * sm_share)

    def decode_attention_time(self, flops: float, bytes_: float, sm_share: float = 1.0) -> float:
        return max(flops / (self.attention_decode_flops * sm_share), bytes_ / self.attention_decode_bytes_per_s)

    # -- communication -----------------------------------------------------------------

    def transfer_time(self, kind: str, bytes_per_rank: float, *, ep: int, low_latency: bool) -> float:
        """One dispatch or combine (`kind`) moving `bytes_per_rank` over the EP layout's
        bottleneck link: NVLink inside a node, RDMA across nodes (DeepEP's normal or
        low-latency table at the nearest published EP size). `comm_latency_s` is one figure for
        every call, or one per kind (a host's measured fixed cost of a dispatch and a combine)."""
        if ep <= 1 or bytes_per_rank <= 0:
            return 0.0
        latency = self.comm_latency_s[kind] if isinstance(self.comm_latency_s, dict) else self.comm_latency_s
        if low_latency:
            return latency + self.low_latency_call(_nearest(self.rdma_low_latency, ep), kind, bytes_per_rank)
        if ep <= self.gpus_per_node:
            rate = self.nvlink_bytes_per_s[kind]
        else:
            rate = _nearest(self.rdma_normal_bytes_per_s, ep)[kind]
        return latency + bytes_per_rank / rate

    def low_latency_call(self, row: dict[str, float], kind: str, bytes_: float) -> float:
        """A low-latency call (`row`: DeepEP's published latency and achieved bandwidth at one
        payload): a fixed part plus the bytes at the NIC's line rate (`rdma_line_bytes_per_s`),
        the two through the published point. The part of the published latency the line rate
        does not explain is fixed per call, so a smaller payload (a ubatch's) saves only the
        wire time. Without a line rate, or where the call beats it (NVLink inside a node), time
        scales with bytes alone."""
        rate = row[f"{kind}_bytes_per_s"]
        line = max(float(self.figures.get("rdma_line_bytes_per_s", rate)), rate)
        return row[f"{kind}_us"] * 1e-6 * (1.0 - rate / line) + bytes_ / line

    def comm_sms(self, low_latency: bool) -> int:
        return self.comm_sms_low_latency if low_latency else self.comm_sms_normal


def _nearest(table: dict[str, Any], ep: int) -> Any:
    key = min(table, key=lambda k: (abs(int(k) - ep), int(k)))
    return table[key]


def load_hardware(name: str) -> HardwareProfile:
    """A built-in profile by name (`h800`, `h100`, `h200`, `b200`) or a profile .json file."""
    return HardwareProfile.load(name)


__all__ = ["HERE", "PROFILES", "HardwareProfile", "load_hardware"]
