"""Issue 30's goals for a GPU run, read from `benchmarks/gpu_check.sh`'s results: each goal with
its figure and a verdict (met, missed, or not measured), for the table the script prints last
and its `summary.json`."""

from __future__ import annotations

#: The whole check must fit 6 minutes of an 8-minute device call.
CHECK_LIMIT_S = 360


def gpu_goals(profile: dict | None, rates: dict | None, elapsed_s: int, *, on_gpu: bool) -> list[dict]:
    """`profile`: `tandem profile --json`'s report; `rates`: `engine_tok_s.py`'s JSON (either
    None when its step did not run). On the CPU every goal is "not measured"."""
    goals: list[dict] = []

    def goal(text: str, figure: str, met: bool | None) -> None:
        goals.append({"goal": text, "figure": figure, "verdict": "not measured" if met is None else "met" if met else "missed"})

    if on_gpu and profile:
        decode, prefill = profile["phases"]["decode"], profile["phases"]["prefill"]
        ratio = decode["step_over_weight_floor"]
        goal(f"decode step <= 2x its weight floor ({profile['graph_mode']} steps, batch {profile['batch']})",
             f"{ratio:.2f}x", ratio <= 2)
        forward = next(r for r in prefill["rows"] if r["row"] == "forward")
        share = forward["flops"] / (forward["ms"] / 1000) / profile["roofline"]["matmul_flops_per_s"]
        goal(f"prefill ({prefill['tokens']} tokens) >= 35 % of the measured {profile['dtype']} matmul peak",
             f"{100 * share:.0f} %", share >= 0.35)
    else:
        goal("decode step <= 2x its weight floor", "-", None)
        goal("prefill >= 35 % of the measured matmul peak", "-", None)
    tok_s = (rates or {}).get("output_tok_s", {})
    if on_gpu and {"eager", "graphs"} <= set(tok_s):
        ratio = tok_s["graphs"] / tok_s["eager"]
        goal(f"graphs >= 1.3x eager ({rates['settings']['requests']} requests)", f"{ratio:.2f}x", ratio >= 1.3)
    else:
        goal("graphs >= 1.3x eager", "-", None)
    goal("no graph captured while serving after start-up", "-", None)  # asserted by the CUDA tests only
    goal(f"the whole check in <= {CHECK_LIMIT_S // 60} minutes", f"{elapsed_s} s", elapsed_s <= CHECK_LIMIT_S if on_gpu else None)
    return goals


def goals_table(goals: list[dict]) -> str:
    lines = ["| goal (issue 30) | figure | verdict |", "|---|---|---|"]
    return "\n".join(lines + [f"| {g['goal']} | {g['figure']} | {g['verdict']} |" for g in goals])


__all__ = ["CHECK_LIMIT_S", "gpu_goals", "goals_table"]
