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


def get_platform(device_type: str | None = None) -> Platform:
    """The platform for `device_type`, or CUDA when available and CPU otherwise.

    Platforms are stateless apart from per-context current streams, so one instance per
    device type is shared.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return _platform_for(device_type)


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
