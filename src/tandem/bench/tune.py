"""`tandem tune`: the smallest token count from which DBO reliably beats no overlap.

For each phase the sweep runs no overlap and DBO back to back in every round, so each
round gives one paired ratio `dbo / none` that a change of machine load between rounds
does not skew; DBO "wins" at a size when the median paired ratio is at most `1 - margin`.
The threshold is the smallest swept size from which DBO wins at that size and at every
larger size tried: a single lucky win below a loss does not count, so the choice sits at
the measured crossover (within one sweep step of it) and moves by at most one step
between runs unless the crossover itself moves. When DBO does not win at the largest size,
the threshold is `NEVER` (DBO off for that phase).
"""

from __future__ import annotations

from dataclasses import dataclass

#: A threshold no step reaches: DBO stays off for that phase.
NEVER = 2**31 - 1


@dataclass
class Decision:
    phase: str
    threshold: int
    #: (tokens, none ms, dbo ms, speedup, wins) per size, ascending.
    table: list[tuple[int, float, float, float, bool]]
    margin: float

    @property
    def reason(self) -> str:
        if self.threshold == NEVER:
            largest = self.table[-1][0] if self.table else 0
            return f"DBO never beat no overlap by {self.margin:.0%} at the largest size ({largest}): off"
        return f"DBO beats no overlap by >= {self.margin:.0%} at {self.threshold} tokens and every larger size tried"


def choose_threshold(phase: str, sizes: list[tuple], margin: float) -> Decision:
    """`sizes`: (tokens, none_ms, dbo_ms[, paired dbo/none ratio]) per swept size; without
    a paired ratio, the ratio of the two medians is used."""
    table = []
    for tokens, none_ms, dbo_ms, *paired in sorted(sizes):
        ratio = paired[0] if paired else (dbo_ms / none_ms if none_ms > 0 else float("inf"))
        table.append((tokens, none_ms, dbo_ms, 1 / ratio if ratio > 0 else float("inf"), ratio <= 1 - margin))
    threshold = NEVER
    for tokens, *_, wins in reversed(table):
        if not wins:
            break
        threshold = tokens
    return Decision(phase, threshold, table, margin)


def paired_ratio(none_records: list[dict], dbo_records: list[dict]) -> float:
    """Median over rounds of DBO's step time over no overlap's, measured in the same round."""
    import statistics

    return statistics.median(d["step_s"] / n["step_s"] for n, d in zip(none_records, dbo_records))


def tune_document(decisions: list[Decision], margin: float, config: dict) -> dict:
    """The thresholds file `tandem tune` writes (and `--thresholds-file` reads): the two
    thresholds, the margin, the settings, and the sweep per phase (the planner's prior)."""
    by_phase = {d.phase: d for d in decisions}
    missing = {"decode", "prefill"} - set(by_phase)
    if missing:
        raise ValueError(f"a thresholds file needs a decision for each phase; missing {', '.join(sorted(missing))}")
    return {
        "dbo_decode_token_threshold": by_phase["decode"].threshold,
        "dbo_prefill_token_threshold": by_phase["prefill"].threshold,
        "margin": margin,
        "config": config,
        "sweep": {
            d.phase: [
                {"tokens_per_rank": t, "none_ms": n, "dbo_ms": b, "paired_speedup": round(x, 4), "dbo_wins": w}
                for t, n, b, x, w in d.table
            ]
            for d in decisions
        },
    }


def format_decisions(decisions: list[Decision], *, speedups_from: str = "median of paired runs") -> str:
    """The verdicts as a table; `speedups_from` says where the speed-ups come from."""
    lines = []
    for d in decisions:
        lines.append(f"{d.phase}: {d.reason}")
        lines.append(f"  {'tokens':>7}{'none ms':>10}{'dbo ms':>10}{'speedup':>9}  verdict (speedup: {speedups_from})")
        for tokens, none_ms, dbo_ms, speedup, wins in d.table:
            verdict = "DBO" if tokens >= d.threshold else ("wins, but not from here on" if wins else "no overlap")
            lines.append(f"  {tokens:>7}{none_ms:>10.2f}{dbo_ms:>10.2f}{speedup:>8.2f}x  {verdict}")
    return "\n".join(lines)


__all__ = ["Decision", "NEVER", "choose_threshold", "format_decisions", "paired_ratio", "tune_document"]
