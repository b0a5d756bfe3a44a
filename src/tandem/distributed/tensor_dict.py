"""Tensor dicts between pipeline stages.

`send_tensor_dict(data, dst)` splits a dict into metadata (keys, shapes, dtypes and the
non-tensor values, pickled) and tensors. The metadata goes first on the gloo CPU group as two
messages (its length, then its bytes), the tensors follow one `isend` each on the device group
in key order; empty tensors are described but never sent. Everything is sent asynchronously:
the call returns a `PendingSend` that owns every buffer of the transfer, so nothing is freed
or reused while it may still be read. Call `PendingSend.wait()` only once the receiver is
known to have the data (the pipeline loop does it when the micro-batch's results came back
around the ring): SGLang shipped wrong outputs when it released the send buffers of a deeper
async pipeline one iteration early (sglang#15527).

`recv_tensor_dict(src)` mirrors it: metadata, then one `irecv` per non-empty tensor into a
fresh tensor on `device`; every wait is bounded by `timeout_s` (a timeout means the peer is
dead or hung: gloo closes the link, so it is fatal for the pipeline).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


#: How long dropping an unfinished `PendingSend` waits for it to complete.
DROP_TIMEOUT_S = 30.0


class StageLinkError(RuntimeError):
    """A transfer between stages failed or timed out: a peer stage is dead or hung."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PendingSend:
    """An in-flight `send_tensor_dict`: its works and the buffers they read."""

    works: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    peer: int = -1

    def wait(self, timeout_s: float = 300.0) -> None:
        """Complete every transfer, then release the buffers."""
        _wait_all(self.works, timeout_s, f"sending to rank {self.peer}")
        self.works.clear()
        self.buffers.clear()

    @property
    def done(self) -> bool:
        return not self.works

    def __del__(self) -> None:
        # Dropping the works of an unfinished gloo send cancels it mid-message (the receiver
        # then waits for a body that never comes): finish it first, bounded.
        if self.works:
            try:
                self.wait(DROP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead peer: nothing left to protect
                pass


def _wait_all(works: list, timeout_s: float, what: str) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    for work in works:
        try:
            work.wait(timeout)
        except RuntimeError as exc:
            raise StageLinkError(f"{what} failed within {timeout_s:g} s (a dead or hung pipeline stage): {exc}") from exc


def _split(data: dict[str, Any]) -> tuple[list[tuple[str, Any]], list[torch.Tensor]]:
    meta: list[tuple[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor dict keys must be strings, got {key!r}")
        if isinstance(value, torch.Tensor):
            meta.append((key, TensorMeta(tuple(value.shape), value.dtype)))
            if value.numel() > 0:
                tensors.append(value.contiguous())
        else:
            meta.append((key, value))
    return meta, tensors


def send_tensor_dict(data: dict[str, Any], dst: int, *, cpu_group, device_group) -> PendingSend:
    """Start sending `data` to global rank `dst`; see the module docstring."""
    meta, tensors = _split(data)
    payload = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.tensor([len(payload)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    try:
        works = [dist.isend(header, dst, group=cpu_group), dist.isend(body, dst, group=cpu_group)]
        works += [dist.isend(tensor, dst, group=device_group) for tensor in tensors]
    except RuntimeError as exc:
        raise StageLinkError(f"sending to rank {dst} failed (a dead pipeline stage): {exc}") from exc
    return PendingSend(works, [header, body, *tensors], dst)


def recv_tensor_dict(
    src: int, *, cpu_group, device_group, device: torch.device | str = "cpu", timeout_s: float = 300.0
) -> dict[str, Any]:
    """Receive one `send_tensor_dict` from global rank `src` (blocking, bounded)."""
    what = f"receiving from rank {src}"
    try:
        header = torch.empty(1, dtype=torch.int64)
        _wait_all([dist.irecv(header, src, group=cpu_group)], timeout_s, what)
        body = torch.empty(int(header.item()), dtype=torch.uint8)
        _wait_all([dist.irecv(body, src, group=cpu_group)], timeout_s, what)
        meta = pickle.loads(body.numpy().tobytes())
        data: dict[str, Any] = {}
        works = []
        for key, value in meta:
            if isinstance(value, TensorMeta):
                tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
                if tensor.numel() > 0:
                    works.append(dist.irecv(tensor, src, group=device_group))
                data[key] = tensor
            else:
                data[key] = value
        _wait_all(works, timeout_s, what)
    except StageLinkError:
        raise
    except RuntimeError as exc:
        raise StageLinkError(f"{what} failed (a dead pipeline stage): {exc}") from exc
    return data


__all__ = ["PendingSend", "StageLinkError", "TensorMeta", "recv_tensor_dict", "send_tensor_dict"]
