"""Which device and dtype a rank runs on, and which process-group backends follow from it.

`--device auto|cpu|cuda` and `--dtype auto|bfloat16|float16|float32` are settings: a rank
resolves them once, at start, and everything else (weights, KV cache, step inputs, the
platform's streams and graphs, the process groups) follows the resolved device, never
`torch.cuda.is_available()` on its own.
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class DeviceUnavailableError(RuntimeError):
    """The asked-for device does not exist on this machine (one line, no traceback wanted)."""


def check_device_flag(device: str) -> None:
    """Validate `--device` where it is given, before any rank starts."""
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceUnavailableError(
            f"--device cuda: CUDA is not available ({build}, torch {torch.__version__}); "
            "use --device cpu, or install a CUDA build of torch"
        )


def check_dtype_flag(dtype: str) -> None:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """`auto` is CUDA when available, else CPU; on CUDA, local rank i of a host takes
    `cuda:{i % device_count}`."""
    check_device_flag(device)
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on CPU."""
    check_dtype_flag(dtype)
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[dtype]


def sm_count(device: torch.device | None = None) -> int | None:
    """The SMs of a CUDA device (the current one by default); None without CUDA, or without a
    driver to ask (fake CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        index = device if device is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).multi_processor_count
    except (RuntimeError, AssertionError):
        return None


def device_group_backend(device: torch.device | str) -> str:
    """The process-group backend for tensor collectives on `device`: NCCL for CUDA tensors,
    gloo for CPU ones."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no process-group backend for device type {kind!r}")


#: The control plane (step decisions, metadata, timing gathers) always runs on CPU tensors.
CPU_GROUP_BACKEND = "gloo"


def to_device_async(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without blocking the host: staged through page-locked
    memory and copied on the current stream (the caching host allocator keeps the staging
    block until the copy is done). Unchanged on CPU, which has no copy to make (and where
    pinning would need a CUDA driver)."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like `like` that a device-to-host copy can fill without
    blocking: page-locked when `like` is on CUDA, plain memory on CPU."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)


__all__ = [
    "CPU_GROUP_BACKEND",
    "DEVICES",
    "DTYPES",
    "DTYPE_CHOICES",
    "DeviceUnavailableError",
    "check_device_flag",
    "check_dtype_flag",
    "device_group_backend",
    "host_buffer",
    "to_device_async",
    "resolve_device",
    "resolve_dtype",
    "sm_count",
]
