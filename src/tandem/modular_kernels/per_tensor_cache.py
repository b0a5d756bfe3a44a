"""`PerTensorCache`: values derived from a tensor (a quantized copy, a repacked layout), made
once and reused until the tensor changes or is freed."""

from __future__ import annotations

import weakref
from typing import Callable

import torch


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


class PerTensorCache:
    """Values derived from tensors, one entry per (live tensor, variant). An entry is reused
    while the tensor is the same object with the same storage, shape and version counter,
    and dropped when the tensor is freed."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, t: torch.Tensor, variant, make: Callable[[], object]):
        key = (id(t), variant)
        stamp = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, _version(t))
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is t and entry[1] == stamp:
            return entry[2]
        value = make()
        entries = self._entries

        def forget(ref, key=key) -> None:
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        self._entries[key] = (weakref.ref(t, forget), stamp, value)
        return value
