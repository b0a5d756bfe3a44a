"""The overlap modes a benchmark compares (`--modes`), and the overlap settings each runs."""

from __future__ import annotations

from dataclasses import replace

from tandem.config import OverlapConfig

#: SGLang's SBO modes, each as its own bench mode (`sbo` and `dbo+sbo` run `auto`).
SBO_MODE_NAMES = {f"sbo-{m}": m for m in ("combine-down-gemm", "combine-shared", "dispatch-shared")}
#: Modes every workload runs: no overlap, DBO on threads or greenlets, SBO (auto or one
#: mode), DBO with SBO, TBO (the ubatches interleaved stage by stage by the stage executor,
#: no threads), and the overlap planner choosing per step (`--overlap-policy auto`).
MODES = ("none", "dbo", "dbo-greenlet", "sbo", "dbo+sbo", *SBO_MODE_NAMES, "tbo", "auto")
PHASES = ("decode", "prefill")


def mode_flags(mode: str) -> tuple[bool, str, str | None]:
    """(DBO on, executor, SBO mode or None) of a mode."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode == "tbo":
        return True, "stages", None
    dbo = mode.startswith("dbo") or mode == "auto"
    sbo = "auto" if mode in ("sbo", "dbo+sbo") else SBO_MODE_NAMES.get(mode)
    return dbo, "greenlet" if mode == "dbo-greenlet" else "thread", sbo


def mode_overlap(base: OverlapConfig, mode: str) -> OverlapConfig:
    """The overlap settings of a mode: fixed modes split every step (thresholds 0) or none;
    `auto` is the planner, falling back to the base's thresholds (a `--thresholds-file`'s)
    or the defaults until it has predictions."""
    dbo, executor, _ = mode_flags(mode)
    if mode == "auto":
        thresholds = base if base.thresholds_file else OverlapConfig()
        return replace(
            base, enable_dbo=True, executor=executor, overlap_policy="auto",
            dbo_decode_token_threshold=thresholds.dbo_decode_token_threshold,
            dbo_prefill_token_threshold=thresholds.dbo_prefill_token_threshold,
        )
    return replace(
        base, enable_dbo=dbo, executor=executor, overlap_policy="static",
        dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0,
    )


__all__ = ["MODES", "PHASES", "SBO_MODE_NAMES", "mode_flags", "mode_overlap"]
