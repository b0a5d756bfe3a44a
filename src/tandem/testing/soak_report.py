"""What a soak's memory did, for people: a plot of each server process's resident memory per
wave, and, from the processes' own memory probes (`tandem.platform.memory_probe`), what each
process's growth after the warm-up is made of."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.testing.soak import WaveResult

#: Probe fields compared between the end of the warm-up and the end of the run, in MB
#: (`python_blocks` is a count).
PROBE_FIELDS = ("rss_mb", "rss_anon_mb", "rss_file_mb", "malloc_in_use_mb", "malloc_free_mb", "malloc_mmap_mb",
                "traced_mb", "python_blocks")


def _nearest(samples: list[dict], when: float) -> dict:
    return min(samples, key=lambda row: abs(row["t"] - when))


def probe_summary(directory: Path, waves: list[WaveResult], warmup: int) -> dict[str, dict[str, float]]:
    """Per probed process (`<name>-<pid>`): each probe field's change from the sample nearest
    the end of the warm-up to the one nearest the end of the last wave."""
    if len(waves) <= warmup + 1:
        return {}
    start, end = waves[warmup].sampled_at, waves[-1].sampled_at
    summary = {}
    for path in sorted(directory.glob("*.jsonl")):
        samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not samples:
            continue
        first, last = _nearest(samples, start), _nearest(samples, end)
        split = {key: last[key] - first[key] for key in PROBE_FIELDS if key in first and key in last}
        summary[path.stem] = split | {"samples": len(samples)}
    return summary


def plot_rss(waves: list[WaveResult], warmup: int, path: Path) -> Path | None:
    """Each process's RSS per wave, the warm-up shaded and adversarial waves marked; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = sorted({name for w in waves for name in w.rss_mb})
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.2 * len(names)), sharex=True, squeeze=False)
    numbers = [w.wave for w in waves]
    for axis, name in zip(axes[:, 0], names):
        values = [w.rss_mb.get(name, float("nan")) for w in waves]
        axis.plot(numbers, values, lw=1.2, color="tab:blue")
        axis.scatter([w.wave for w in waves if w.adversarial],
                     [w.rss_mb.get(name, float("nan")) for w in waves if w.adversarial], s=6, color="tab:red",
                     label="adversarial wave", zorder=3)
        axis.axvspan(numbers[0] - 0.5, warmup + 0.5, color="0.85", label=f"warm-up ({warmup} waves, measured)")
        if len(waves) > warmup:
            base = waves[warmup].rss_mb.get(name, float("nan"))
            axis.axhline(base * 1.01, color="tab:green", ls="--", lw=0.8, label="+1 % over the end of the warm-up")
        axis.set_ylabel(f"{name}\nRSS MB")
    axes[0, 0].legend(loc="lower right", fontsize=7)
    axes[-1, 0].set_xlabel("wave")
    fig.suptitle("tandem serve soak: resident memory per process after each wave")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["PROBE_FIELDS", "plot_rss", "probe_summary"]
