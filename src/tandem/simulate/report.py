"""The table `tandem simulate` prints, and the validation against DeepSeek's published throughput."""

from __future__ import annotations

from tandem.simulate.host_loop import format_loops
from tandem.simulate.run import Simulation, simulate

#: DeepSeek-V3 on H800 in DeepSeek's published settings (deepseek-ai/profile-data README:
#: prefill EP32, 4K prompts, 16K tokens per GPU, two micro-batches; decode EP128, 4K context,
#: 128 requests per GPU, two micro-batches). The tokens/s/GPU are the SGLang team's reading of
#: those traces (lmsys.org blog 2025-05-05 "large-scale EP", "DeepSeek Profile": 62,713 and
#: 18,598 tokens/s per 8-GPU node; InferSim's README quotes the same 7,839 and 2,324). The
#: decode trace verifies one MTP draft per request (the blog: 128 requests "generate 256 tokens
#: per decode step", attention as slow as MTP makes it) and its tokens/s count 60 % of the drafts
#: kept ("we conservatively assume a 60% acceptance rate").
PUBLISHED = (
    dict(phase="prefill", ep=32, tokens_per_rank=16384, context=4096, mode="dbo", tokens_per_s=7839),
    dict(phase="decode", ep=128, tokens_per_rank=128, context=4096, mode="tbo", tokens_per_s=2324,
         draft_tokens=1, acceptance=0.6),
)


def format_table(sim: Simulation) -> str:
    """Each mode's step; with a host figure (`host_step_ms`), below it each mode's step under
    the normal and the overlapped scheduler loop (`host_loop.format_loops`)."""
    w, lay = sim.workload, sim.layout
    if sim.hardware.transfers_on_compute:
        kernels = "gloo transfers on the computing cores"
    else:
        kernels = f"{'low-latency' if lay.low_latency else 'normal'} DeepEP kernels"
    head = (
        f"{sim.model.name} on {sim.hardware.name}, DP-attention x EP{lay.ep} ({kernels}), "
        f"{w.phase}: {w.tokens_per_rank} tokens/rank, context {w.context}"
    ) + (f", {w.draft_tokens} MTP draft/request ({w.acceptance:.0%} kept)" if w.draft_tokens else "")
    rows = [f"{'mode':<22}{'step ms':>10}{'tok/s/GPU':>12}{'vs none':>9}{'compute ms':>12}{'comm ms':>10}{'floor ms':>10}{'vs floor':>9}"]
    for r in sim.results:
        speed = sim.speedup(r)
        rows.append(
            f"{r.mode:<22}{r.step_s * 1e3:>10.2f}{r.tokens_per_s:>12.0f}{'' if speed is None else f'{speed:.2f}x':>9}"
            f"{r.compute_s * 1e3:>12.2f}{r.comm_s * 1e3:>10.2f}{r.floor_s * 1e3:>10.2f}{r.step_s / r.floor_s:>8.2f}x"
        )
    table = "\n".join([head, *rows])
    return table if sim.host_step_s is None else f"{table}\n\n{format_loops(sim)}"


def validation_rows(hardware: str = "h800") -> list[dict]:
    """Predicted vs published tokens/s/GPU for DeepSeek-V3 in DeepSeek's settings."""
    out = []
    for case in PUBLISHED:
        sim = simulate("deepseek-v3", hardware, ep=case["ep"], phase=case["phase"], tokens_per_rank=case["tokens_per_rank"],
                       context=case["context"], modes=("none", case["mode"]), draft_tokens=case.get("draft_tokens", 0),
                       acceptance=case.get("acceptance", 0.0))
        predicted = sim.results[-1].tokens_per_s
        out.append({**case, "predicted": predicted, "error": predicted / case["tokens_per_s"] - 1.0})
    return out


def format_validation(rows: list[dict]) -> str:
    lines = [f"{'phase':<9}{'EP':>5}{'mode':>6}{'published':>11}{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(f"{r['phase']:<9}{r['ep']:>5}{r['mode']:>6}{r['tokens_per_s']:>11}{r['predicted']:>11.0f}{r['error']:>+9.1%}")
    return "\n".join(lines)


__all__ = ["PUBLISHED", "format_table", "format_validation", "validation_rows"]
