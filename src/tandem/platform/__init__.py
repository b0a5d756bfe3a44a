"""Device abstraction: streams, events and graphs for CUDA and for CPU."""

from __future__ import annotations

import functools

import torch

from tandem.platform.base import Event, Platform
from tandem.platform.cpu import CpuEvent, CpuPlatform, CpuStream
from tandem.platform.graph import Graph, GraphCaptureError, graph_capture_active


@functools.lru_cache(maxsize=None)
def _platform_for(device_type: str) -> Platform:
    if device_type == "cuda":
        from tandem.platform.cuda import CudaPlatform

        return CudaPlatform()
    if device_type == "cpu":
        return CpuPlatform()
    raise ValueError(f"unsupported device type {device_type!r}: expected 'cpu' or 'cuda'")


def get_platform(device: str | torch.device | None = None) -> Platform:
    """The platform of `device` (a device type such as "cuda", or a device such as
    `torch.device("cuda", 1)` or "cuda:1"); with none, CUDA when available and CPU otherwise.
    Code that holds tensors passes their device, so the platform follows the data.

    Platforms are stateless apart from per-context current streams, so one instance per
    device type is shared.
    """
    if device is None:
        return _platform_for("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        return _platform_for(device.type)
    return _platform_for(device.split(":", 1)[0])


__all__ = [
    "CpuEvent",
    "CpuPlatform",
    "CpuStream",
    "Event",
    "Graph",
    "GraphCaptureError",
    "Platform",
    "get_platform",
    "graph_capture_active",
]
