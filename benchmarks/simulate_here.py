"""`tandem simulate --hardware here` against `tandem bench` on this host, in the same run (#31).

One run: this host's profile is measured (`tandem.simulate.host`: the roofline's matmul rate and
bandwidth on one thread, a 32-row matmul on a warm weight and over cold weights, the ubatch
hand-over, gloo's dispatch and combine between two real ranks, the elementwise and routing lines
the stack's non-GEMM ops are priced at), then `tandem bench --model
moe-stack` runs on 2 gloo ranks over loopback (modes none and dbo, decode and prefill, a few
token counts), then the simulator predicts the same rows on the measured profile. Nothing is
fitted to the bench: every figure of the profile is the host's own measurement.

First the profile's figures the prediction turns on (matmul rate and short-GEMM curve, cold
weight read rate, gloo's fixed cost and rate per dispatch and combine, hand-over, the elementwise
lines), and the load
average (the rows are only as good as the machine is quiet). Per row: the measured step (median
of the bench's repeats, and their [min, max]), the predicted step, the error, within +-10 %
yes / no, the sign of (mode - none) measured and predicted, and the verdict. Beside each row
the terms of the model, measured against predicted, so a miss names the term that is off:

- compute: the unsplit step's computation (bench: the floor's compute-only step);
- transfer CPU: the all-to-all's time on the cores and the ops the communication-only step runs
  around it (router, select_experts, the residual add) (bench: the floor's communication-only step);
- split loss: what the split adds beyond its hand-overs (the halves' shorter GEMMs, each weight read
  again, each transfer's fixed cost paid per ubatch): the mode's step minus none's minus the
  switch cost, on both sides;
- switch cost: the hand-overs between ubatches (bench: the time model's switch time);
- imbalance and waits: the step minus the terms above (the model has none: its ranks are equal).

    python benchmarks/simulate_here.py          # ~80 s on 2 cores
    python benchmarks/simulate_here.py --quick  # smoke run: one size per phase, 2 repeats

Prints the table and writes benchmarks/results/simulate_here.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.simulate import HardwareProfile, simulate
from tandem.simulate.hardware import HERE
from tandem.simulate.host import resolve_hardware

MODEL, RANKS, MODES = "moe-stack", 2, ("none", "dbo")
#: The goal of #31 for this host: every row within +-10 % of the step measured in the same run.
TOLERANCE = 0.10
TOKENS = {"decode": [32, 128, 512], "prefill": [128, 512]}
QUICK_TOKENS = {"decode": [128], "prefill": [128]}
RESULT = Path(__file__).resolve().parent / "results" / "simulate_here.json"
TERMS = ("compute", "transfer CPU", "split loss", "switch cost", "imbalance and waits")


def measure_rows(phase: str, tokens: list[int], repeat: int, warmup: int) -> list[dict]:
    """`tandem bench`'s rows for one phase: real gloo ranks on this host."""
    with tempfile.TemporaryDirectory(prefix="simulate-here-") as folder:
        path = Path(folder) / "bench.json"
        command = [
            sys.executable, "-m", "tandem", "bench", "--model", MODEL, "--data-parallel-size", str(RANKS),
            "--phase", phase, "--tokens", ",".join(map(str, tokens)), "--modes", ",".join(MODES),
            "--repeat", str(repeat), "--warmup", str(warmup), "--json", str(path),
        ]
        print("$", " ".join(command[1:]), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
        return json.loads(path.read_text())["rows"]


def predict_terms(hw: HardwareProfile, phase: str, tokens: int) -> dict[str, dict[str, float]]:
    """Per mode: the predicted step and its terms in ms. The switch cost is the step with the
    measured hand-over minus the step with none (the same schedule played twice)."""
    free = HardwareProfile(hw.name, {**hw.figures, "ubatch_switch_s": 0.0}, hw.sources)
    # The bench's MoE stack attends to no cache: one key per query prices its stand-in alone.
    run = dict(ep=RANKS, phase=phase, tokens_per_rank=tokens, context=1, modes=MODES)
    with_switch, without = simulate(MODEL, hw, **run).results, simulate(MODEL, free, **run).results
    none = without[0]
    out = {}
    for result, unswitched in zip(with_switch, without):
        out[result.mode] = {
            "step": 1e3 * result.step_s,
            "compute": 1e3 * none.compute_s,
            "transfer CPU": 1e3 * (none.comm_s + _comm_step_ops_s(none)),
            "split loss": 1e3 * (unswitched.step_s - none.step_s),
            "switch cost": 1e3 * (result.step_s - unswitched.step_s),
        }
    return out


#: The ops the bench's communication-only step runs besides its transfers: the router's GEMM,
#: select_experts and the residual add (the stack's `h + kernel(h)`; the simulator's layer puts
#: it in the next layer's `comm_prepare_attn`).
COMM_STEP_OPS = ("gate", "select_experts", "comm_prepare_attn")


def _comm_step_ops_s(result) -> float:
    """Seconds of `COMM_STEP_OPS` in a predicted step: the transfer-CPU term counts them as the bench's does."""
    return sum(s.end - s.start for s in result.spans if s.lane == "compute" and s.step.name in COMM_STEP_OPS)


def measured_terms(row: dict, none_row: dict) -> dict[str, float]:
    """The same terms from the bench's row of a mode and of none (same phase and size)."""
    switch = row["time_model"]["switch_ms"]
    return {
        "step": row["step_ms"],
        "compute": row["compute_ms"],
        "transfer CPU": row["comm_ms"],
        "split loss": row["step_ms"] - none_row["step_ms"] - switch if row["mode"] != "none" else 0.0,
        "switch cost": switch,
    }


def with_rest(terms: dict[str, float]) -> dict[str, float]:
    named = sum(terms[t] for t in TERMS[:-1])
    return {**terms, "imbalance and waits": terms["step"] - named}


def compare(rows: list[dict], hw: HardwareProfile) -> list[dict]:
    """One comparison per (phase, tokens, mode): measured and predicted step and terms."""
    out = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        for tokens in dict.fromkeys(r["tokens_per_rank"] for r in rows if r["phase"] == phase):
            cell = {r["mode"]: r for r in rows if r["phase"] == phase and r["tokens_per_rank"] == tokens}
            predicted = predict_terms(hw, phase, tokens)
            for mode in MODES:
                measured = with_rest(measured_terms(cell[mode], cell["none"]))
                model = with_rest(predicted[mode])
                error = model["step"] / measured["step"] - 1.0
                gaps = {t: model[t] - measured[t] for t in TERMS}
                out.append({
                    "phase": phase, "tokens_per_rank": tokens, "mode": mode,
                    "measured_ms": round(measured["step"], 3), "predicted_ms": round(model["step"], 3),
                    "measured_min_ms": cell[mode]["step_ms_min"], "measured_max_ms": cell[mode]["step_ms_max"],
                    "error": round(error, 4), "met": abs(error) <= TOLERANCE,
                    "sign_measured": _sign(measured["step"] - cell["none"]["step_ms"]) if mode != "none" else None,
                    "sign_predicted": _sign(model["step"] - predicted["none"]["step"]) if mode != "none" else None,
                    "measured_terms_ms": {t: round(measured[t], 3) for t in TERMS},
                    "predicted_terms_ms": {t: round(model[t], 3) for t in TERMS},
                    "term_off": max(gaps, key=lambda t: abs(gaps[t])),
                })
    return out


def _sign(delta_ms: float) -> str:
    return "+" if delta_ms > 0 else "-"


def format_table(rows: list[dict]) -> str:
    lines = [f"{'phase':<8}{'tokens':>7} {'mode':<5}{'measured ms':>12}{'[min, max]':>17}{'predicted ms':>13}{'error':>9}"
             f"{'+-10%':>6}{'sign (mode-none) meas/pred':>28}  verdict"]
    for r in rows:
        sign = "" if r["sign_measured"] is None else f"{r['sign_measured']} / {r['sign_predicted']}"
        sign += "" if r["sign_measured"] == r["sign_predicted"] else " (wrong)"
        verdict = "met" if r["met"] else f"MISSED: {r['term_off']} off by " \
            f"{r['predicted_terms_ms'][r['term_off']] - r['measured_terms_ms'][r['term_off']]:+.1f} ms"
        spread = f"[{r['measured_min_ms']:.0f}, {r['measured_max_ms']:.0f}]"
        lines.append(f"{r['phase']:<8}{r['tokens_per_rank']:>7} {r['mode']:<5}{r['measured_ms']:>12.1f}{spread:>17}"
                     f"{r['predicted_ms']:>13.1f}{r['error']:>+9.1%}{'yes' if r['met'] else 'no':>6}{sign:>28}  {verdict}")
    lines.append("\nterms, measured / predicted ms: " + ", ".join(TERMS))
    for r in rows:
        cells = ", ".join(f"{r['measured_terms_ms'][t]:.1f} / {r['predicted_terms_ms'][t]:.1f}" for t in TERMS)
        lines.append(f"{r['phase']:<8}{r['tokens_per_rank']:>7} {r['mode']:<5} {cells}")
    return "\n".join(lines)


def unresolved_figures(hw: HardwareProfile) -> list[str]:
    """The measured rates the profile prices as free (infinite: the measurement resolved no cost
    per unit, its source says so), each as `figure` or `figure[kind]`."""
    out = []
    for name, value in hw.figures.items():
        for kind, rate in (value.items() if isinstance(value, dict) else [(None, value)]):
            if isinstance(rate, float) and math.isinf(rate):
                out.append(name if kind is None else f"{name}[{kind}]")
    return out


def format_warnings(hw: HardwareProfile) -> str:
    """One warning line per figure priced as free ("" when none)."""
    return "\n".join(f"warning: {name} was not resolved by its measurement (slope <= 0, or the cold pass not slower "
                     f"than the warm): priced as free, every row that uses it is too fast" for name in unresolved_figures(hw))


def _rate(value: float, scale: float, unit: str) -> str:
    return "free (not resolved)" if math.isinf(value) else f"{value / scale:.2f} {unit}"


def format_profile(hw: HardwareProfile) -> str:
    """The profile's figures the prediction turns on, as measured in this run."""
    f = hw.figures
    link = ", ".join(f"{k} {1e3 * f['comm_latency_s'][k]:.2f} ms + {_rate(f['nvlink_bytes_per_s'][k], 1e9, 'GB/s')}"
                     for k in f["nvlink_bytes_per_s"])
    return (f"profile: matmul {f['bf16_flops'] / 1e9:.0f} GFLOP/s (gemm_m_half {f['gemm_m_half']:.1f} rows), "
            f"cold weights read at {_rate(f['cold_weight_bytes_per_s'], 1e9, 'GB/s')}, gloo {link}, "
            f"hand-over {1e6 * f['ubatch_switch_s']:.1f} us{_elementwise_line(f)}")


def _elementwise_line(f: dict) -> str:
    if "elementwise_op_s" not in f:
        return ""
    fixed, rate = f["elementwise_op_s"], f["elementwise_units_per_s"]
    return (f"; after a cold GEMM: add {1e6 * fixed['plain']:.0f} us + {_rate(rate['plain'], 1e9, 'GB/s')}, tanh "
            f"{1e6 * fixed['transcendental']:.0f} us + {_rate(rate['transcendental'], 1e9, 'GB/s')}, select_experts "
            f"{1e6 * fixed['routing']:.0f} us + {_rate(rate['routing'], 1e6, 'M tokens/s')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="One size per phase, 2 repeats.")
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args()
    tokens, repeat, warmup = (QUICK_TOKENS, 2, 1) if args.quick else (TOKENS, 5, 2)
    load_before = os.getloadavg()[0]
    hw = resolve_hardware(HERE, RANKS)  # measured first, in this process, as tandem simulate --hardware here does
    rows = [row for phase, sizes in tokens.items() for row in measure_rows(phase, sizes, repeat, warmup)]
    table = compare(rows, hw)
    load = (round(load_before, 2), round(os.getloadavg()[0], 2))
    print(f"{MODEL}, {RANKS} gloo ranks over loopback: tandem bench (median of {repeat}) against "
          f"tandem simulate --hardware here (measured in this run); load average {load[0]:.1f} at the start, "
          f"{load[1]:.1f} at the end ({os.cpu_count()} cores: above ~0.5 the rows are noisy)")
    print(format_profile(hw))
    if warnings := format_warnings(hw):
        print(warnings)
    print(format_table(table))
    met = sum(r["met"] for r in table)
    signs = [r for r in table if r["sign_measured"] is not None]
    print(f"\nwithin +-{TOLERANCE:.0%}: {met} of {len(table)} rows; sign of (mode - none) right on "
          f"{sum(r['sign_measured'] == r['sign_predicted'] for r in signs)} of {len(signs)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"rows": table, "profile": {k: {"value": v, "source": hw.sources[k]} for k, v in hw.figures.items()},
                "config": {"model": MODEL, "ranks": RANKS, "modes": list(MODES), "tokens": tokens, "repeat": repeat,
                           "warmup": warmup, "tolerance": TOLERANCE, "load_average_start_end": list(load)}}
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
