"""The GPU kernels a step really launches, by name, from `torch.profiler` (CUPTI): one step of
each phase run under the profiler, after the timed ones, and its device-side events summed
per kernel name (ATen's, cuBLAS's, Triton's alike, memcpy and memset too): count, total and
mean µs, share of the step's device time. Only on CUDA; the CPU has no device events.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

TOP = 25


def _is_device_row(row) -> bool:
    device_type = getattr(row, "device_type", None)
    return device_type is not None and device_type == torch.autograd.DeviceType.CUDA


def _device_us(row) -> float:
    """A row's device time in µs (`device_time_total`; `cuda_time_total` on older torch)."""
    for name in ("device_time_total", "self_device_time_total", "cuda_time_total"):
        value = getattr(row, name, None)
        if value:
            return float(value)
    return 0.0


def summarise_kernels(rows: Iterable, top: int = TOP) -> dict:
    """`key_averages()`'s device-side rows (`device_type` CUDA: one per kernel name) as the
    top `top` by total time, each `{"name", "count", "total_us", "mean_us", "share"}`, with
    the totals over every kernel (those past the top included)."""
    by_name: dict[str, list[float]] = {}
    for row in rows:
        if not _is_device_row(row):
            continue
        count_us = by_name.setdefault(str(row.key), [0, 0.0])
        count_us[0] += int(row.count)
        count_us[1] += _device_us(row)
    total_us = sum(us for _, us in by_name.values())
    ranked = sorted(by_name.items(), key=lambda item: (-item[1][1], item[0]))
    kernels = [
        {"name": name, "count": count, "total_us": us, "mean_us": us / count if count else 0.0,
         "share": us / total_us if total_us else 0.0}
        for name, (count, us) in ranked[:top]
    ]  # fmt: skip
    return {
        "kernels": kernels, "distinct_kernels": len(by_name), "launches": sum(c for c, _ in by_name.values()),
        "device_us": total_us,
    }


def profile_step(step: Callable[[], None], device: torch.device, top: int = TOP) -> dict:
    """Runs `step()` once under `torch.profiler` with CUDA activity; its kernel summary."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return summarise_kernels(prof.key_averages(), top)


def format_kernels(phase: str, summary: dict) -> list[str]:
    """One phase's summary as a Markdown table (lines), or the error that stopped the pass."""
    if "error" in summary:
        return ["", f"## {phase}: GPU kernels (torch.profiler): not recorded ({summary['error']})"]
    lines = [
        "",
        f"## {phase}: GPU kernels (torch.profiler): {summary['launches']} launches of "
        f"{summary['distinct_kernels']} kernels, {summary['device_us'] / 1000:.3f} ms on the device; "
        f"top {len(summary['kernels'])} by time",
        "",
        "| kernel | count | total µs | mean µs | % device |",
        "|---|---|---|---|---|",
    ]
    for k in summary["kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| {name.replace('|', '/')} | {k['count']} | {k['total_us']:.1f} | {k['mean_us']:.2f} | "
                     f"{100 * k['share']:.1f} |")
    return lines


SKIPPED_ON_CPU = "GPU kernels (torch.profiler): skipped, the device is not CUDA"

__all__ = ["SKIPPED_ON_CPU", "TOP", "format_kernels", "profile_step", "summarise_kernels"]
