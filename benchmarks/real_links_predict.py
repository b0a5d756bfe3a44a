"""Predictions of `benchmarks/real_links.py`'s rows (#31): `tandem simulate --hardware here`,
measured in the same run before the ranks start (gloo over loopback, outside the namespaces),
with the transfers' CPU part taken from each job's own dispatch and combine line over the
unshaped veth, and each rate's wire part from that job's probes
(`tandem.simulate.shaped_link.ShapedLink.calibrated`). Per row: measured against predicted, the
error, the sign of (mode - none) both ways, and the simulated terms between the step and its
floor; beside it the overlap model alone (every CPU cost scaled to the row's measured compute).

A script module beside real_links.py (benchmarks are scripts, not a package): real_links.py
imports it from its own directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time


#: The goal of #31 on this host: every real-link row within +-10 % of the step measured in the same run.
TOLERANCE = 0.10
#: Modes the simulator plays, as it names them; dbo-greenlet is DBO at the greenlet executor's hand-over.
SIMULATED = {"none": "none", "dbo": "dbo", "dbo-greenlet": "dbo", "tbo": "tbo", "sbo-combine-down-gemm": "sbo-combine-down-gemm",
             "sbo-combine-shared": "sbo-combine-shared", "sbo-dispatch-shared": "sbo-dispatch-shared"}
CUSTOM_SHAPE = "a custom stack shape: the simulator's moe-stack is tandem bench's"
NOT_SIMULATED = {
    "auto": "not predicted as a mode: the planner picks none or dbo per step, starting from the simulator's "
            "none and dbo at this row (the row's auto_prior)",
}


def measure_host() -> dict:
    """`--hardware here` for the 2 ranks, measured on this host in this run (outside the
    namespaces, gloo over loopback: the transfers' CPU part never crosses the shaped link), and
    the greenlet executor's hand-over beside the thread executor's."""
    from tandem.simulate.host import host_profile, measure_switch_s

    start = time.perf_counter()
    hw = host_profile(2)
    greenlet = measure_switch_s("greenlet")
    return {
        "figures": hw.figures, "sources": hw.sources, "name": hw.name, "greenlet_switch_s": greenlet,
        "measured_in_s": time.perf_counter() - start, "load_average": os.getloadavg()[0],
    }


def _profile(host: dict, **figures):
    """The host profile with `figures` replaced (each a value, or a (value, source) pair)."""
    from tandem.simulate import HardwareProfile

    values = {k: v[0] if isinstance(v, tuple) else v for k, v in figures.items()}
    sources = {k: v[1] for k, v in figures.items() if isinstance(v, tuple)}
    return HardwareProfile(host["name"], {**host["figures"], **values}, {**host["sources"], **sources})


def _replaced(hw, **figures):
    from tandem.simulate import HardwareProfile

    return HardwareProfile(hw.name, {**hw.figures, **figures}, hw.sources)


def _veth_figures(job: dict) -> dict:
    """The transfers' CPU part as the job measured it over the unshaped veth (`_veth_line`), in
    place of the loopback line; none where the job has no such measurement. (The ranks' skew it
    also measured is not priced: rank 0's timed calls already hold its waits for the peer.)"""
    from tandem.simulate.host_link import LinkFit

    points = job.get("veth_line_points")
    if not points:
        return {}
    line = LinkFit.from_points({k: [tuple(p) for p in v] for k, v in points.items()})
    how = ("measured in this run: the runtime's torch_a2a dispatch and combine between the two namespace hosts over "
           "the unshaped veth (no tbf), float32, median on rank 0, a least-squares line through ("
           + "; ".join(line.describe(kind) for kind in line.points) + ")")
    return {"nvlink_bytes_per_s": (line.bytes_per_s, f"{how}: its slope, per byte sent per rank"),
            "comm_latency_s": (line.fixed_s, f"{how}: its intercept, fixed per call")}


def _sim_args(job: dict, plan: dict) -> dict:
    """The simulator's step for a job: the stack attends to no cache (one key per query prices its
    stand-in); small-moe decodes `tokens` requests over `context_len` cached tokens, or prefills
    one `tokens`-token prompt per rank."""
    if job["workload"] == "moe-stack":
        context = 1
    else:
        context = plan["context_len"] if job["phase"] == "decode" else job["tokens"]
    return dict(ep=2, phase=job["phase"], tokens_per_rank=job["tokens"], context=context)


def _steps_s(model: str, hw, args: dict, modes: list[str], busy: dict | None = None) -> dict[str, float]:
    """Each mode's simulated step; with `busy`, each mode's compute-stream time is put there too."""
    from tandem.simulate import simulate

    results = simulate(model, hw, modes=modes, **args).results
    if busy is not None:
        busy.update({r.mode: r.compute_s for r in results})
    return {r.mode: r.step_s for r in results}


def link_probes(job: dict) -> list[tuple[float, float]]:
    """(Mbit/s, comm seconds of the none step) the job measured its link at: the probe, half its
    rate (a run before it recorded the half probe's rate: none) and each row's rate just before
    the row (`rate_probes`; a run before them: none)."""
    probes = [(job["probe_mbit"], job["probe_comm_s"])]
    if "half_probe_comm_s" in job:
        probes.append((job["probe_mbit"] / 2, job["half_probe_comm_s"]))
    return probes + [tuple(p) for p in job.get("rate_probes", ())]


def _link(job: dict, rate: float, wire_bytes: float):
    from tandem.simulate.shaped_link import ShapedLink

    probes = link_probes(job)
    how = (f"the none step's comm (shaped minus unshaped) at {len(probes)} rates ("
           + ", ".join(f"{mbit:.0f} Mbit/s {s * 1e3:.1f} ms" for mbit, s in sorted(probes))
           + ") over the bytes the simulated step sends")
    return ShapedLink.calibrated(rate, probes=[(mbit, s / wire_bytes) for mbit, s in probes], exponent=job["fit_alpha"], how=how)


@dataclasses.dataclass(frozen=True)
class CalibratedJob:
    """A job as the simulator plays it: its model and step, the host profile with the job's own
    transfer CPU line (`_veth_figures`) and its other CPU costs scaled so that the unshaped none
    step is the one the job measured at its start (`cpu_scale`), and its link at any rate from the
    job's probes. The row predictions and the auto mode's prior both start here, so they price
    the same host and link.

    Why the scale: the profile is measured before the ranks start, outside the namespaces, and
    the ranks' own steps ran 5-24 % slower than it says in the runs that probed every row's
    rate; the link is calibrated from that same measured unshaped step (its probes are shaped
    minus unshaped), so a profile that prices the unshaped step otherwise puts the difference
    into every row (two such runs: 41 and 57 of 84 rows within +-10 % unscaled, 57 and 67 scaled;
    a run before the row probes, 60 and 58). It also puts what the transfers add to the unshaped
    step beyond their timed calls (not modelled) into every CPU cost alike. A job without its own
    line keeps the host's loopback line unscaled; a scale that is not a positive number (a
    measured step shorter than the simulated transfers alone) is refused."""

    model: str
    args: dict
    base: object  # tandem.simulate.HardwareProfile
    wire_bytes: float
    probe_seconds_per_byte: float
    job: dict
    #: The simulated none step on `base` (no link: the unshaped step).
    unshaped_none_s: float
    #: Every CPU cost of the host profile but the job's own transfer line times this (1: the job
    #: measured no unshaped none step).
    cpu_scale: float = 1.0

    @classmethod
    def of(cls, job: dict, plan: dict, host: dict) -> "CalibratedJob":
        from tandem.simulate.shaped_link import ShapedLink, over_link

        model, args = job["workload"], _sim_args(job, plan)
        f = host["figures"]
        # The transfer line a job is priced with, never scaled: its own over the veth (measured
        # on the ranks), else the host's loopback line.
        line = _veth_figures(job) or {k: f[k] for k in ("comm_latency_s", "nvlink_bytes_per_s")}
        base = _profile(host, **line)
        unshaped, scale = _steps_s(model, base, args, ["none"])["none"], 1.0
        if job.get("unshaped_none_s"):
            # The none step is its compute and its transfers in sequence: compute alone takes the
            # measured step less the transfers.
            alone = _steps_s(model, _transfers_free(base), args, ["none"])["none"]
            scale = (job["unshaped_none_s"] - (unshaped - alone)) / alone
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"{model} {job['phase']}: the measured unshaped none step ({job['unshaped_none_s'] * 1e3:.1f} ms) "
                                 f"is not longer than its simulated transfers ({(unshaped - alone) * 1e3:.1f} ms): no CPU scale")
            base = _profile({**host, "figures": _slowed(_profile(host), scale).figures}, **line)
            unshaped = _steps_s(model, base, args, ["none"])["none"]
        unit = over_link(base, ShapedLink(1.0, 1.0, "one second per byte: the step's wire bytes"))
        wire_bytes = _steps_s(model, unit, args, ["none"])["none"] - unshaped
        return cls(model, args, base, wire_bytes, job["probe_comm_s"] / wire_bytes, job, unshaped, scale)

    def link(self, rate_mbit: float):
        """The shaped link at `rate_mbit`: its wire from the probes, the packets' CPU from the
        job's compute-under-transfer measurement where it has one."""
        link = _link(self.job, rate_mbit, self.wire_bytes)
        cpu_per_byte, cpu_how = _wire_cpu_per_byte(self.job, self.wire_bytes)
        link = link if cpu_per_byte is None else link.with_cpu_per_byte(cpu_per_byte, cpu_how)
        under = self.job.get("compute_under_transfer") or {}
        if "wire_rate" not in under:  # a run before the wire's side was measured
            return link
        if not resolved_slower(under["beside_loop_s"], under["wire_s"]):
            return link.with_wire_rate(1.0, (
                f"not resolved: an all-to-all beside a matmul loop took {_ms_range(under['beside_loop_s'])} ms, alone "
                f"{_ms_range(under['wire_s'])} ms at {under['rate_mbit']:.0f} Mbit/s (the ranges overlap), priced as 1.00"))
        how = (f"an all-to-all issued beside a matmul loop on both ranks took {_median_ms(under['beside_loop_s'])} ms, "
               f"{_median_ms(under['wire_s'])} alone, the loop {_median_ms(under['under_transfer_s'])} of it, at "
               f"{under['rate_mbit']:.0f} Mbit/s: the wire kept {under['wire_rate']:.2f} of its pace while the loop ran")
        return link.with_wire_rate(under["wire_rate"], how)


def predict_job(job: dict, plan: dict, host: dict) -> dict:
    """Every (rate, mode) row of one job predicted on the host profile over a link calibrated by
    the job's own probes; per row the simulation's terms between the step and its floor."""
    from tandem.simulate.shaped_link import ShapedLink

    if "shape" in job:
        return {"not_modelled": CUSTOM_SHAPE}
    c = CalibratedJob.of(job, plan, host)
    # The greenlet executor's hand-over is a CPU cost like the thread executor's in `c.base`.
    scaled_host = {**host, "greenlet_switch_s": host["greenlet_switch_s"] * c.cpu_scale}
    rows = [_predict_row(row, c.model, c.args, c.base, scaled_host, c.link(row["rate_mbit"]), ShapedLink.nominal(row["rate_mbit"]))
            for row in job["rows"]]
    f = c.base.figures
    cpu_line = ", ".join(f"{k} {f['comm_latency_s'][k] * 1e3:.2f} ms + {f['nvlink_bytes_per_s'][k] / 1e9:.2f} GB/s"
                         for k in ("dispatch", "combine"))
    where = "the unshaped veth" if job.get("veth_line_points") else "loopback"
    return {"wire_bytes_per_step": c.wire_bytes, "probe_seconds_per_byte": c.probe_seconds_per_byte, "cpu_scale": c.cpu_scale,
            "transfer_cpu_line": f"{cpu_line} (over {where})", "unshaped_split": _unshaped_split(c), "rows": rows}


def _transfers_free(hw):
    """`hw` with transfers that cost nothing: its steps are compute alone."""
    f = hw.figures
    return _replaced(hw, comm_latency_s={k: 0.0 for k in f["comm_latency_s"]},
                     nvlink_bytes_per_s={k: float("inf") for k in f["nvlink_bytes_per_s"]})


def _unshaped_split(c: CalibratedJob) -> dict | None:
    """The job's unshaped none step split into compute alone and what the transfers add to it,
    measured (the step and the compute-only step at the job's start) and predicted (the step on
    the job's profile, and on it with transfers free); None where the job measured no
    compute-only step. The measured part also holds the step's agreement all-reduce (the none
    step agrees with the other rank first, the compute-only step does not), which the
    simulator does not price."""
    measured_alone = c.job.get("compute_alone_s")
    if measured_alone is None or c.job.get("unshaped_none_s") is None:
        return None
    alone = _steps_s(c.model, _transfers_free(c.base), c.args, ["none"])["none"]
    measured_step = c.job["unshaped_none_s"]
    return {"compute_alone_s": {"measured": measured_alone, "predicted": alone},
            "transfer_cpu_s": {"measured": measured_step - measured_alone, "predicted": c.unshaped_none_s - alone}}


def auto_prior(job: dict, plan: dict, host: dict, rate_mbit: float) -> dict | None:
    """The `tandem tune` document the auto mode starts from at a row: the simulator's none and
    DBO (2 ubatches at the thread executor's hand-over: the one split auto can choose in the
    bench, `tandem.bench.modes`) for the job's step at `rate_mbit`, on the profile and link the
    row's predictions use. Filed under the phase the planner costs the step as: the MoE stack's
    steps are decode steps to it (no KV attention). None for a job the simulator has no model of."""
    from tandem import tune_sweep
    from tandem.simulate.prior import simulated_step_tune
    from tandem.simulate.shaped_link import over_link

    if "shape" in job:
        return None
    c = CalibratedJob.of(job, plan, host)
    return simulated_step_tune(
        c.model, over_link(c.base, c.link(rate_mbit)), ranks=c.args["ep"], num_ubatches=2, phase=job["phase"],
        tokens_per_rank=job["tokens"], context=c.args["context"], margin=tune_sweep.MARGIN,
        costed_as="decode" if job["workload"] == "moe-stack" else job["phase"],
    )


def _play(model: str, args: dict, base, host: dict, link, modes: list[str]) -> dict:
    """The simulated steps of a row's modes on `base` over `link`: as played, with free hand-overs,
    and with free hand-overs on the unshaped link (the split's compute alone); none's compute and
    wire."""
    from tandem.simulate.shaped_link import over_link

    sims = list(dict.fromkeys(SIMULATED[m] for m in modes))
    free_switch = _replaced(base, ubatch_switch_s=0.0)
    greenlet = over_link(_replaced(base, ubatch_switch_s=host["greenlet_switch_s"]), link)
    busy: dict[str, float] = {}
    out = {"step": _steps_s(model, over_link(base, link), args, sims, busy), "busy": busy,
           "greenlet": _steps_s(model, greenlet, args, ["dbo"]) if "dbo-greenlet" in modes else {},
           "no_switch": _steps_s(model, over_link(free_switch, link), args, sims),
           # Free hand-overs, packets that take no CPU and a wire compute does not slow: what the
           # transfers and compute take from each other on the cores is the difference.
           "no_packet_cpu": _steps_s(model, over_link(free_switch, dataclasses.replace(link, compute_rate=1.0, wire_rate=1.0)),
                                     args, sims),
           "unshaped": _steps_s(model, free_switch, args, sims)}
    out["compute"] = out["unshaped"]["none"]
    out["comm"] = out["step"]["none"] - out["compute"]
    return out


def _mode_step(played: dict, mode: str) -> float:
    return played["greenlet"]["dbo"] if mode == "dbo-greenlet" else played["step"][SIMULATED[mode]]


def _median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.1f}"


def resolved_slower(slow: list[float], fast: list[float]) -> bool:
    """Whether the repeats resolve `slow` as slower than `fast`: every one of its samples above
    every one of the other's. The wire's pace beside compute is a difference of near-equal noisy
    times that sets every overlapped row's wire; one run read 0.28 from samples whose ranges
    overlapped (0.14-0.26 s beside the loop, 0.13-0.25 alone), which made the split modes'
    wire-bound rows 20-59 % too slow."""
    return min(slow) > max(fast)


def kept_under_transfer(alone: list[float], busy: list[float]) -> tuple[float, bool]:
    """(the share of its core a loop keeps while a transfer is on the wire, whether the repeats
    resolve a loss): the ratio of the means of the loop timed alone and under a transfer, at
    most 1, resolved where the mean under a transfer is above every loop alone. The mean, not
    the median: the samples under a transfer are bimodal (in some the transfer's threads got no
    core and the loop ran as alone: 61 and 118-138 ms against 62-72 alone), and a step meets
    many transfers, so it pays the average loss."""
    return min(statistics.mean(alone) / statistics.mean(busy), 1.0), statistics.mean(busy) > max(alone)


def _ms_range(samples: list[float]) -> str:
    return f"{min(samples) * 1e3:.0f}-{max(samples) * 1e3:.0f}"


def _wire_cpu_per_byte(job: dict, wire_bytes: float) -> tuple[float | None, str]:
    """CPU seconds per wire byte from the run's `_compute_under_transfer`: the share of a core the
    loop lost while the transfer trickled through, over the wire's seconds per byte at that rate
    (packets cost per byte, so the share grows with the rate). None where the job has none."""
    under = job.get("compute_under_transfer")
    if not under:
        return None, ""
    # In the job's link's units (its calibrated seconds per byte), which `with_cpu_per_byte`
    # divides by at each row's rate: at the measurement's own rate the loss is the measured one.
    at = _link(job, under["rate_mbit"], wire_bytes).seconds_per_byte
    busy, alone = under["under_transfer_s"], under["alone_s"]
    kept, resolved = kept_under_transfer(alone, busy)
    if not resolved:
        return 0.0, (f"not resolved: a matmul loop on both ranks took {_ms_range(busy)} ms (mean {statistics.mean(busy) * 1e3:.0f}) "
                     f"while an all-to-all was on the wire at {under['rate_mbit']:.0f} Mbit/s, {_ms_range(alone)} ms alone, "
                     "priced as no loss")
    how = (f"a matmul loop on both ranks kept {kept:.2f} of its core (mean of {len(busy)}) while an all-to-all outlasted "
           f"it on the wire at {under['rate_mbit']:.0f} Mbit/s ({at * 1e9:.1f} ns per byte there)")
    return (1.0 - kept) * at, how


def _predict_row(row: dict, model: str, args: dict, base, host: dict, link, nominal) -> dict:
    from tandem.simulate.shaped_link import over_link

    measured = row["step_s"]
    modes = [m for m in measured if m in SIMULATED]
    played = _play(model, args, base, host, link, modes)
    compute, comm = played["compute"], played["comm"]
    # The overlap model alone: every CPU cost of the profile scaled so that the unshaped none
    # step is the one this row measured (the load of the run, not the profile's, sets it).
    scale = row["compute_s"] / compute
    at_measured = _play(model, args, _slowed(base, scale), host, link, modes)
    nominal_comm = _steps_s(model, over_link(base, nominal), args, ["none"])["none"] - compute
    out = {"rate_mbit": row["rate_mbit"], "link_seconds_per_byte": link.seconds_per_byte, "link_source": link.source,
           "link_compute_rate": link.compute_rate, "link_compute_rate_source": link.compute_rate_source,
           "compute_s": {"measured": row["compute_s"], "predicted": compute},
           "comm_s": {"measured": row["comm_s"], "predicted": comm, "nominal_link": nominal_comm},
           "floor_s": {"measured": row["floor_s"], "predicted": max(compute, comm)},
           "cpu_scale_to_measured_compute": scale, "modes": {}}
    for mode, value in measured.items():
        if mode not in SIMULATED:
            out["modes"][mode] = {"measured_s": value, "not_modelled": NOT_SIMULATED.get(mode, "not modelled")}
            continue
        sim, predicted = SIMULATED[mode], _mode_step(played, mode)
        terms = _terms(predicted, played["no_switch"][sim], played["no_packet_cpu"][sim], played["unshaped"][sim], compute,
                       comm) if sim != "none" else {"no overlap": predicted - max(compute, comm)}
        out["modes"][mode] = _verdict(mode, value, predicted, measured["none"], played["step"]["none"], row["floor_s"], terms)
        if mode != "none":
            out["modes"][mode]["sign_resolved"] = _sign_resolved(row["samples_s"], mode)
        # Busy: the step less its receive waits (measured: the time model's; simulated: the
        # compute stream's ops, the transfers' CPU part and hand-overs among them).
        out["modes"][mode]["busy_s"] = {"measured": value - row["recv_wait_s"][mode], "predicted": played["busy"][sim]}
        overlap_only = _mode_step(at_measured, mode)
        out["modes"][mode]["at_measured_compute"] = {"predicted_s": overlap_only, "error": overlap_only / value - 1.0}
    return out


#: The host profile's figures that are rates (a CPU cost divides by them) and fixed times.
_RATES = ("hbm_bytes_per_s", "bf16_flops", "fp8_flops", "cold_weight_bytes_per_s", "attention_decode_flops",
          "attention_decode_bytes_per_s", "nvlink_bytes_per_s", "elementwise_units_per_s", "fused_experts_weight_bytes_per_s",
          "fused_experts_flops")
_FIXED = ("comm_latency_s", "elementwise_op_s", "ubatch_switch_s")


def _slowed(hw, factor: float):
    """`hw` with every CPU cost `factor` times its own (rates divided, fixed times multiplied);
    the link untouched."""
    def scaled(value, by):
        return {k: v * by for k, v in value.items()} if isinstance(value, dict) else value * by

    figures = {k: scaled(v, 1.0 / factor) for k, v in hw.figures.items() if k in _RATES}
    figures.update({k: scaled(v, factor) for k, v in hw.figures.items() if k in _FIXED})
    return _replaced(hw, **figures)


def _terms(step: float, no_switch: float, no_packet_cpu: float, split_compute: float, compute: float,
           comm: float) -> dict[str, float]:
    """Where the simulated step sits above its floor max(compute, comm), in seconds, summing to
    the gap: the hand-overs (switch cost); the CPU the transfers' packets take from compute while
    they are on the wire (transfer CPU); what the split adds to the bound (split loss: the halves'
    shorter GEMMs, every weight read again, each transfer's fixed CPU paid per ubatch); and the
    time one stream still waits on the other: on a wire-bound row the wire waiting on the CPU
    before each send (wire waits), on a compute-bound row the wire the overlap did not hide
    (exposed wire). The ranks' imbalance is not modelled."""
    bound = max(split_compute, comm)
    waits = "wire waits" if comm >= split_compute else "exposed wire"
    return {"switch cost": step - no_switch, "transfer CPU": no_switch - no_packet_cpu,
            "split loss": bound - max(compute, comm), waits: no_packet_cpu - bound, "imbalance": 0.0}


def _verdict(mode, measured, predicted, measured_none, predicted_none, floor, terms) -> dict:
    error = predicted / measured - 1.0
    out = {"measured_s": measured, "predicted_s": predicted, "error": error, "met": abs(error) <= TOLERANCE,
           "predicted_terms_s": terms, "short_of_floor_s": measured - floor}
    if mode != "none":
        out["sign_measured"] = "+" if measured > measured_none else "-"
        out["sign_predicted"] = "+" if predicted > predicted_none else "-"
        out["sign_right"] = out["sign_measured"] == out["sign_predicted"]
    return out


def _sign_resolved(samples: dict[str, list[float]], mode: str) -> bool:
    """Whether the run resolved the sign of (mode - none): every repeat of the mode on the same
    side of every repeat of none (their ranges do not overlap)."""
    ours, none = samples.get(mode, []), samples.get("none", [])
    if not ours or not none:
        return False
    return max(ours) < min(none) or min(ours) > max(none)


def predict(result: dict, host: dict) -> dict:
    """Every job of a real-links result predicted on `host` (`measure_host`)."""
    jobs = [{"workload": j["workload"], "phase": j["phase"], "tokens": j["tokens"], **predict_job(j, result["plan"], host)}
            for j in result["jobs"]]
    rows = [m for j in jobs for r in j.get("rows", []) for m in r["modes"].values() if "predicted_s" in m]
    # The none rows' link is probed at their own rate just before them: the overlap modes are the test.
    overlapped = [m for j in jobs for r in j.get("rows", []) for mode, m in r["modes"].items() if "predicted_s" in m and mode != "none"]
    signs = [m for m in rows if "sign_right" in m]
    resolved = [m for m in signs if m.get("sign_resolved")]
    listed = sorted({mode for j in jobs for r in j.get("rows", []) for mode, m in r["modes"].items() if "not_modelled" in m})
    return {"jobs": jobs, "tolerance": TOLERANCE, "rows": len(rows), "met": sum(m["met"] for m in rows),
            "overlap_rows": len(overlapped), "overlap_met": sum(m["met"] for m in overlapped),
            "met_at_measured_compute": sum(abs(m["at_measured_compute"]["error"]) <= TOLERANCE for m in rows),
            "signs": len(signs), "signs_right": sum(m["sign_right"] for m in signs), "signs_resolved": len(resolved),
            "signs_resolved_right": sum(m["sign_right"] for m in resolved), "not_modelled_modes": listed}


def format_predictions(predictions: dict, host: dict) -> str:
    f = host["figures"]
    link = ", ".join(f"{k} {f['comm_latency_s'][k] * 1e3:.2f} ms + {f['nvlink_bytes_per_s'][k] / 1e9:.2f} GB/s" for k in ("dispatch", "combine"))
    lines = [f"predicted (tandem simulate --hardware here, measured in this run at load {host['load_average']:.1f}: matmul "
             f"{f['bf16_flops'] / 1e9:.0f} GFLOP/s, gloo {link}, hand-over thread {f['ubatch_switch_s'] * 1e6:.0f} us / "
             f"greenlet {host['greenlet_switch_s'] * 1e6:.0f} us; each link calibrated from its job's probes)"]
    for job in predictions["jobs"]:
        lines.append(f"\n{job['workload']} {job['phase']} {job['tokens']} tok/rank")
        if "not_modelled" in job:
            lines.append(f"  {job['not_modelled']}")
            continue
        lines.append(f"  transfer CPU part: {job['transfer_cpu_line']}; wire {job['wire_bytes_per_step'] / 1e6:.2f} MB a step "
                     f"leaving a rank, {job['probe_seconds_per_byte'] * 1e9:.1f} ns/byte at the probe; every CPU cost "
                     f"but that line x {job.get('cpu_scale', 1.0):.3f}, so the unshaped none step is the job's")
        if split := job.get("unshaped_split"):
            a, t = split["compute_alone_s"], split["transfer_cpu_s"]
            lines.append(f"  unshaped none step: compute alone {a['measured'] * 1e3:.0f} / {a['predicted'] * 1e3:.0f} ms "
                         f"({a['predicted'] / a['measured'] - 1:+.1%}), the transfers (and the step's agreement) "
                         f"{t['measured'] * 1e3:.0f} / {t['predicted'] * 1e3:.0f} ms (measured / predicted)")
        lines.append(f"{'Mbit/s':>7} {'mode':<20}{'meas ms':>9}{'pred ms':>9}{'error':>8}{'+-10%':>6}{'sign m/p':>10}"
                     f"{'at meas. C':>16}{'busy m / p':>13}  simulated terms above the floor (ms)")
        for r in job["rows"]:
            c, w = r["compute_s"], r["comm_s"]
            lines.append(f"{r['rate_mbit']:7.0f} compute {c['measured'] * 1e3:.0f} / {c['predicted'] * 1e3:.0f} ms, comm "
                         f"{w['measured'] * 1e3:.0f} / {w['predicted'] * 1e3:.0f} ms (nominal link {w['nominal_link'] * 1e3:.0f}), "
                         f"floor {r['floor_s']['measured'] * 1e3:.0f} / {r['floor_s']['predicted'] * 1e3:.0f} ms (measured / predicted), "
                         f"compute keeps {r['link_compute_rate']:.2f} of its core under a transfer")
            for mode, m in r["modes"].items():
                lines.append(_format_mode(mode, m))
    lines.append(f"\nwithin +-{predictions['tolerance']:.0%}: {predictions['met']} of {predictions['rows']} rows "
                 f"({predictions.get('overlap_met', '?')} of the {predictions.get('overlap_rows', '?')} overlapped ones); sign of "
                 f"(mode - none) right on {predictions['signs_right']} of {predictions['signs']} ({predictions['signs_resolved_right']} "
                 f"of the {predictions['signs_resolved']} the repeats resolve: no overlap of their ranges); with the CPU costs scaled to "
                 f"each row's measured compute (the overlap model alone): {predictions['met_at_measured_compute']} of "
                 f"{predictions['rows']} within +-{predictions['tolerance']:.0%}; not modelled (listed, "
                 f"not predicted): {', '.join(predictions['not_modelled_modes']) or 'none'}")
    return "\n".join(lines)


def _format_mode(mode: str, m: dict) -> str:
    if "not_modelled" in m:
        return f"{'':7} {mode:<20}{m['measured_s'] * 1e3:9.0f}{'':9}  {m['not_modelled']}"
    sign = "" if "sign_right" not in m else f"{m['sign_measured']}/{m['sign_predicted']}" + ("" if m["sign_right"] else " WRONG")
    sign += "" if m.get("sign_resolved", True) else "?"
    terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in m["predicted_terms_s"].items() if k != "imbalance" and abs(v) >= 5e-4)
    at, busy = m["at_measured_compute"], m["busy_s"]
    return (f"{'':7} {mode:<20}{m['measured_s'] * 1e3:9.0f}{m['predicted_s'] * 1e3:9.0f}{m['error']:+8.1%}"
            f"{'yes' if m['met'] else 'no':>6}{sign:>10}{at['predicted_s'] * 1e3:9.0f} {at['error']:+6.1%}"
            f"{busy['measured'] * 1e3:7.0f} /{busy['predicted'] * 1e3:4.0f}  {terms or '-'}")
