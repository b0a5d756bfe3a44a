"""Tensor dicts between pipeline stages, one message per transfer.

A `StageLink` joins this rank to one peer. `send(data)` frames a dict as one byte message on
the gloo CPU group: a fixed-size header (magic, metadata length, frame length, overflow
length), the pickled metadata (keys, shapes, dtypes and the non-tensor values), then the bytes
of every CPU tensor. Tensors on another device (CUDA) follow on the device group, one `isend`
each in key order; empty tensors are described but never sent.

Why one message with the receive already posted: a gloo receive posted *after* the peer sent
costs several wake-ups of both sides' transport threads (measured on a loaded 2-core machine:
about 4 ms per message, against 0.36 ms for a receive posted in advance), and the old framing
(length, then pickled metadata, then each tensor, each posted only once the previous one had
arrived) paid it three times per transfer. So a link keeps one receive of `capacity_bytes`
posted (`expect()`) and re-posts it as soon as a message is taken; gloo fills a larger buffer
with a smaller message, and the header says how much of it is the frame. A frame over the
capacity is sent as a header alone, then the frame in a second message of its exact size (the
receiver learns it from the header): correct for any size, fast for the sizes a link is made
for (decode micro-batches).

Every send is asynchronous: it returns a `PendingSend` that owns its buffer, so nothing is
freed or reused while it may still be read. Call `PendingSend.wait()` only once the receiver
is known to have the data (the pipeline loop does it when the micro-batch's results came back
around the ring): SGLang shipped wrong outputs when it released the send buffers of a deeper
async pipeline one iteration early (sglang#15527). Every wait of a receive is bounded by its
`timeout_s` (a timeout means the peer is dead or hung: gloo closes the link, so it is fatal
for the pipeline).
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
#: Default receive buffer of a link: a decode micro-batch of hidden states fits many times over.
DEFAULT_CAPACITY_BYTES = 1 << 20

_MAGIC = 0x7464_6C6B  # "tdlk"
_HEADER_WORDS = 4  # magic, metadata bytes, frame bytes (header included), overflow bytes
_HEADER_BYTES = 8 * _HEADER_WORDS


class StageLinkError(RuntimeError):
    """A transfer between stages failed or timed out: a peer stage is dead or hung."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: Packed into the CPU message (CPU tensors) rather than sent on the device group.
    inline: bool


@dataclass
class PendingSend:
    """An in-flight send: its works and the buffers they read."""

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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class StageLink:
    """This rank's end of a link to global rank `peer` (both directions: messages between
    two ranks arrive in the order they were sent)."""

    def __init__(self, peer: int, *, cpu_group, device_group, device: torch.device | str = "cpu",
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES):
        if capacity_bytes < _HEADER_BYTES:
            raise ValueError(f"a link's capacity must hold its {_HEADER_BYTES}-byte header, got {capacity_bytes}")
        self.peer = peer
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.device = torch.device(device)
        self.capacity_bytes = capacity_bytes
        self._buffer = torch.empty(capacity_bytes, dtype=torch.uint8)
        self._posted = None

    # -- sending --------------------------------------------------------------------------

    def send(self, data: dict[str, Any]) -> PendingSend:
        """Start sending `data`; see the module docstring."""
        meta: list[tuple[str, Any]] = []
        inline: list[torch.Tensor] = []
        device_tensors: list[torch.Tensor] = []
        for key, value in data.items():
            if not isinstance(key, str):
                raise TypeError(f"tensor dict keys must be strings, got {key!r}")
            if isinstance(value, torch.Tensor):
                on_host = value.device.type == "cpu"
                meta.append((key, TensorMeta(tuple(value.shape), value.dtype, on_host)))
                if value.numel() > 0:
                    (inline if on_host else device_tensors).append(value if on_host else value.contiguous())
            else:
                meta.append((key, value))
        payload = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        parts = [_as_bytes(t) for t in inline]
        frame_len = _HEADER_BYTES + len(payload) + sum(p.numel() for p in parts)
        frame = torch.empty(frame_len, dtype=torch.uint8)
        header = frame[:_HEADER_BYTES].view(torch.int64)
        header[0], header[1], header[2], header[3] = _MAGIC, len(payload), frame_len, 0
        frame[_HEADER_BYTES : _HEADER_BYTES + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = _HEADER_BYTES + len(payload)
        for part in parts:
            frame[offset : offset + part.numel()] = part
            offset += part.numel()
        buffers = [frame, *device_tensors]
        try:
            if frame_len <= self.capacity_bytes:
                works = [dist.isend(frame, self.peer, group=self.cpu_group)]
            else:
                alone = torch.tensor([_MAGIC, len(payload), _HEADER_BYTES, frame_len], dtype=torch.int64)
                buffers.append(alone)
                works = [dist.isend(alone.view(torch.uint8), self.peer, group=self.cpu_group),
                         dist.isend(frame, self.peer, group=self.cpu_group)]
            works += [dist.isend(t, self.peer, group=self.device_group) for t in device_tensors]
        except RuntimeError as exc:
            raise StageLinkError(f"sending to rank {self.peer} failed (a dead pipeline stage): {exc}") from exc
        return PendingSend(works, buffers, self.peer)

    # -- receiving ------------------------------------------------------------------------

    def expect(self) -> None:
        """Post the receive of the next message now (if it is not posted yet), so it is
        waiting when the peer sends. Post only when a message will surely come: a receive
        left posted at the end outlives the link."""
        if self._posted is None:
            try:
                self._posted = dist.irecv(self._buffer, self.peer, group=self.cpu_group)
            except RuntimeError as exc:
                raise StageLinkError(f"receiving from rank {self.peer} failed (a dead pipeline stage): {exc}") from exc

    def recv(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Receive one message (blocking, bounded). Call `expect()` right after it when
        another message will follow."""
        what = f"receiving from rank {self.peer}"
        try:
            self.expect()
            work, self._posted = self._posted, None
            _wait_all([work], timeout_s, what)
            header = self._buffer[:_HEADER_BYTES].view(torch.int64).tolist()
            if header[0] != _MAGIC:
                raise StageLinkError(f"{what}: not a stage message (bad header {header[:1]})")
            meta_len, frame_len, overflow = header[1], header[2], header[3]
            if overflow:
                frame = torch.empty(overflow, dtype=torch.uint8)
                _wait_all([dist.irecv(frame, self.peer, group=self.cpu_group)], timeout_s, what)
            else:
                frame = self._buffer[:frame_len].clone()
            meta = pickle.loads(frame[_HEADER_BYTES : _HEADER_BYTES + meta_len].numpy().tobytes())
            offset = _HEADER_BYTES + meta_len
            data: dict[str, Any] = {}
            works = []
            for key, value in meta:
                if not isinstance(value, TensorMeta):
                    data[key] = value
                    continue
                if value.inline:
                    tensor = torch.empty(value.shape, dtype=value.dtype)
                    nbytes = tensor.numel() * tensor.element_size()
                    if nbytes:
                        tensor.reshape(-1).view(torch.uint8).copy_(frame[offset : offset + nbytes])
                    offset += nbytes
                    data[key] = tensor.to(self.device, non_blocking=True) if self.device.type != "cpu" else tensor
                else:
                    tensor = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                    if tensor.numel() > 0:
                        works.append(dist.irecv(tensor, self.peer, group=self.device_group))
                    data[key] = tensor
            _wait_all(works, timeout_s, what)
        except StageLinkError:
            raise
        except RuntimeError as exc:
            raise StageLinkError(f"{what} failed (a dead pipeline stage): {exc}") from exc
        return data


__all__ = ["DEFAULT_CAPACITY_BYTES", "PendingSend", "StageLink", "StageLinkError", "TensorMeta"]
