"""A CPU emulation of DeepEP's Python API (`import deep_ep`) on torch.distributed (gloo).

DeepEP needs NVLink/RDMA GPUs, so tandem's DeepEP adapters are tested against this module
instead: it has the same classes, signatures, return tuples, data layouts and host-side
checks as `deep_ep.Buffer`, and moves the data with gloo all-to-alls. Put it in place with
`install()` (or the `installed()` context manager) and `import deep_ep` returns it.

What is emulated (the legacy `Buffer` API of DeepEP v2.1, intranode high-throughput +
low-latency):

- `Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank, ...,
  enable_shrink)`: the constructor's checks and its collective handshake (every rank must
  build it); one NVSHMEM (low-latency) Buffer per process at a time, as `nvshmem::init`
  allows (beyond 8 ranks a second one fails DeepEP's host assert; below, it costs another
  full RDMA buffer); `nvshmem_qp_depth` from `NVSHMEM_QP_DEPTH` (default 1024).
- `get_dispatch_layout` → `(num_tokens_per_rank, None, num_tokens_per_expert,
  is_token_in_rank, event)`.
- `dispatch` → `(recv_x | (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
  num_recv_tokens_per_expert_list, handle, event)`: rows grouped by source rank, ascending
  token order inside a rank; top-k ids made local (-1 for experts on other ranks, weight 0
  there). The receive counts are exchanged synchronously (the real library spins the CPU on
  them too); the data moves asynchronously and is only guaranteed after
  `event.current_stream_wait()` when `async_finish=True`.
- `combine` → `(combined_x, combined_topk_weights, event)`: a plain (unweighted) sum of the
  rows sent back, accumulated in float32, plus optional bias.
- `low_latency_dispatch` → `(recv_x | (fp8, scales), recv_count, handle, event, hook)`:
  `recv_x [E_local, T*R, H]` packed per expert, rows from source rank r contiguous and
  ordered by source rank (ascending token order inside), `recv_count[e]` valid rows, the
  rest stale; fp8 is DeepEP's per-128-channel cast (amax floored at 1e-4, optionally
  power-of-two / UE8M0 scales) with scales `[E_local, T*R, H/128]` stored column-major;
  handle `(src_info, layout_range, T, hidden, num_experts)`.
- `low_latency_combine` → `(combined_x, event, hook)`: weighted sum over the top-k (ids of
  -1 skipped), accumulated in float32.
- With `return_recv_hook=True` the transfer is only issued: the received tensors hold stale
  data until `hook()` runs (once). `async_finish` and `return_recv_hook` are exclusive.
- Stream order of hooks: `hook()` launches the receive on the stream that was current at
  *send* time (as DeepEP's hook does), deferred on the CPU platform's stream order: it
  completes when an event recorded behind it on that stream is waited, or when the buffer
  is read on that stream. Reading a received tensor before that (before the hook ran, or on
  another stream with no event between) raises; so does a receive whose `topk_idx` /
  `topk_weights` were freed before it ran (DeepEP holds raw pointers to them).
- Low-latency limits: `(T + 1) * 2 <= nvshmem_qp_depth` (a Python assert in DeepEP),
  `num_ranks * T % 4 == 0` (TMA), top-k at most 11, the instantiated hidden sizes.
- `topk_idx_t` (int64 unless `install(topk_idx_dtype=...)` emulates a 32-bit build); every
  top-k id tensor must have that dtype.
- `EventOverlap` (with `current_stream_wait(release_handle)`, `register_hook_after_wait`
  and the `with` form), `EventHandle`,
  `Buffer.capture`, `Config` (+ size hints), `get_dispatch_config`, `get_combine_config`,
  `set_num_sms`, `get_low_latency_rdma_size_hint` (DeepEP's buffer arithmetic),
  `clean_low_latency_buffer`, `get_next_low_latency_combine_buffer` (+ `zero_copy`).

Host checks raise `RuntimeError` (as DeepEP's `EP_HOST_ASSERT` does), Python-level asserts
raise `AssertionError`. Two things the real library does not check but corrupts silently
raise here instead: expert ids outside `[-1, num_experts)`, and issuing a third low-latency
operation while the one two calls back still waits for its receive (DeepEP keeps two
low-latency buffers and alternates between them).

Not emulated: internode (> 8 ranks) high-throughput kernels, `num_worst_tokens`, mpi4py
`comm`, LogFMT's precision loss (`use_logfmt` is accepted, lossless), CUDA streams for the
event (non-hook) paths (events block the CPU instead of a stream), and the arrival-order nondeterminism of the real
low-latency packing (here rows are always in source-rank, then token order).

`install(allow_float32=True)` relaxes the bf16-only checks for tests of the emulation's own
arithmetic; adapters are tested without it, in bf16 as DeepEP requires.
"""

from __future__ import annotations

import contextlib
import math
import sys
import os
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "Buffer",
    "Config",
    "EmulationOptions",
    "EventHandle",
    "EventOverlap",
    "install",
    "installed",
    "uninstall",
]

NUM_MAX_NVL_PEERS = 8
NUM_MAX_RDMA_PEERS = 20
NUM_MAX_LOCAL_EXPERTS = 1024
NUM_BUFFER_ALIGNMENT_BYTES = 128
_INT_MAX = 2**31 - 1
_SOURCE_META_BYTES = 8  # internode::SourceMeta: two ints
#: hidden sizes DeepEP's low-latency kernels are instantiated for.
LL_SUPPORTED_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: `kNumMaxTopK` of the low-latency kernels.
LL_MAX_TOPK = 11
#: NVSHMEM queue-pair depth when `NVSHMEM_QP_DEPTH` is not set.
DEFAULT_NVSHMEM_QP_DEPTH = 1024
_FP8 = torch.float8_e4m3fn
_FP8_AMAX = 448.0
_FP8_MARGIN = 1e-4
#: what stale receive rows hold (a finite value, so masked maths stays finite).
_STALE = 7.0


class DeepEPHostAssertion(RuntimeError):
    """A failed host-side check (DeepEP's `EP_HOST_ASSERT`)."""


def _host_assert(cond, what: str) -> None:
    if not cond:
        raise DeepEPHostAssertion(f"Assertion error (emulated deep_ep): {what}")


def _check_matrix(t: torch.Tensor, name: str) -> None:
    _host_assert(t.dim() == 2 and t.is_contiguous(), f"{name}.dim() == 2 and {name}.is_contiguous()")


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class EmulationOptions:
    #: accept float32 where DeepEP only takes bf16 (for exact comparisons on CPU).
    allow_float32: bool = False
    #: fill rows that carry no data (and not-yet-received tensors) with a stale value.
    poison: bool = True
    #: `deep_ep.topk_idx_t`: int64 unless DeepEP was built with `EP_NUM_TOPK_IDX_BITS=32`.
    topk_idx_dtype: torch.dtype = torch.int64


# ---------------------------------------------------------------------------- events


class _Transfer:
    """Issued collectives plus the step that unpacks what they received; completes once."""

    def __init__(self, works: list, on_complete: Callable[[], None] | None = None):
        self._works = works
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self.done = False
        #: the receive hook ran (its receive is launched, maybe not complete yet)
        self.issued = False
        #: `(stream, work id)` of the launched receive on the CPU platform
        self.launched = None

    def complete(self) -> None:
        with self._lock:
            if self.done:
                return
            for work in self._works:
                work.wait()
            if self._on_complete is not None:
                self._on_complete()
            self.done = True


class EventHandle:
    """`deep_ep_cpp.EventHandle`: an event recorded after the communication kernels. On CPU,
    waiting blocks until the transfer has completed; a new handle is already complete."""

    def __init__(self, _transfer: _Transfer | None = None):
        self._transfer = _transfer

    def current_stream_wait(self) -> None:
        if self._transfer is not None:
            self._transfer.complete()


class EventOverlap:
    """`deep_ep.utils.EventOverlap`: wraps an event (None when the call was synchronous),
    with v2.1's `current_stream_wait(release_handle)`, `register_hook_after_wait` and the
    `with event(release_handle=True):` form."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable[[], None]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def _launch_stream():
    """The stream a hook's receive goes on: the one current at send time (DeepEP captures
    `compute_stream` by value into the hook), with the platform that orders it; None where
    the platform cannot defer work (the receive then completes at once)."""
    from tandem.platform import get_platform

    platform = get_platform("cpu")
    if not hasattr(platform, "enqueue"):
        return None
    return platform, platform.current_stream()


def _recv_hook(transfer: _Transfer, launch) -> Callable[[], None]:
    called = []

    def hook() -> None:
        if called:
            raise RuntimeError("deep_ep (emulated): a receive hook may only be called once")
        called.append(True)
        transfer.issued = True
        if launch is None:
            transfer.complete()
            return
        platform, stream = launch
        transfer.launched = platform.enqueue(transfer.complete, stream)

    return hook


class _ReceiveBuffer(torch.Tensor):
    """A receive buffer handed out before its receive ran: any read (a torch op on it, not
    its metadata) is checked against the stream order. On the stream the receive was
    launched on, the read waits for it (stream order); anywhere else, or before the hook
    ran, it is an error: on a GPU it would read stale memory."""

    _METADATA = frozenset(
        {"__get__", "size", "dim", "stride", "numel", "is_contiguous", "element_size", "data_ptr", "storage_offset",
         "__len__", "__hash__"}
    )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in cls._METADATA:
            for arg in _tensor_args(args, kwargs):
                transfer = getattr(arg, "_deep_ep_transfer", None)
                if transfer is not None:
                    _check_received(transfer)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _tensor_args(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from _tensor_args(value, {})
        elif isinstance(value, torch.Tensor):
            yield value


def _check_received(transfer: "_Transfer") -> None:
    if transfer.done:
        return
    launched = getattr(transfer, "launched", None)
    if launched is None:
        raise RuntimeError(
            "deep_ep (emulated): a low-latency receive buffer was read before its receive hook ran (the real "
            "kernel has not written it: stale memory)"
        )
    from tandem.platform import get_platform

    platform = get_platform("cpu")
    stream, work_id = launched
    current = platform.current_stream()
    if current is not stream:
        raise RuntimeError(
            f"deep_ep (emulated): a low-latency receive buffer was read on {current} while its receive, launched "
            f"by the hook on {stream} (the stream current at send time), had not completed and nothing ordered "
            f"{current} after it: run the hook, then record an event on {stream} and wait on it before reading"
        )
    platform.complete_through(stream, work_id)


def _guarded(tensor: Optional[torch.Tensor], transfer: "_Transfer") -> Optional[torch.Tensor]:
    if tensor is None:
        return None
    out = tensor.as_subclass(_ReceiveBuffer)
    out._deep_ep_transfer = transfer
    return out


# ---------------------------------------------------------------------------- config


class Config:
    """`deep_ep.Config`: chunking of the high-throughput kernels."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        _host_assert(num_sms >= 0, "num_sms >= 0")
        _host_assert(
            num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0,
            "num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0",
        )
        _host_assert(
            num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
            "num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens",
        )
        _host_assert(
            num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
            "num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0",
        )
        num_max_rdma_chunked_recv_tokens = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        _host_assert(
            num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens,
            "num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens",
        )
        _host_assert(
            num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2,
            "num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens / 2",
        )
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
            f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
            f"{self.num_max_rdma_chunked_recv_tokens}))"
        )

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        max_topk = max_scales = 128
        _host_assert(
            num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0,
            "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0",
        )
        _host_assert(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0, "num_sms % 2 == 0")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks
        recv = self.num_max_nvl_chunked_recv_tokens
        total = slots * (2 * rdma_ranks + 3) * 4
        total += slots * recv * (hidden_bytes + _SOURCE_META_BYTES + max_topk * 8 + max_topk * 4 + max_scales * 4)
        return _align(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        max_topk = max_scales = 128
        _host_assert(num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % NUM_MAX_NVL_PEERS == 0")
        _host_assert(self.num_sms % 2 == 0, "num_sms % 2 == 0")
        slots = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        recv = self.num_max_rdma_chunked_recv_tokens
        total = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        per_token = hidden_bytes + _SOURCE_META_BYTES + max_topk * 8 + max_topk * 4 + max_scales * 4 + 16
        total += slots * recv * 2 * per_token
        return _align(total, 128)


def _low_latency_layout_bytes(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Bytes of DeepEP's two low-latency send/receive/signal buffers (sized for bf16)."""
    T, E = num_max_dispatch_tokens_per_rank, num_experts
    num_scales = hidden // 128
    _host_assert(num_scales * 4 <= hidden, "num_scales * sizeof(float) <= hidden")
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(T * dispatch_msg, E * T * combine_msg)
    recv = max(E * T * dispatch_msg, E * T * combine_msg)
    _host_assert(send % 16 == 0 and recv % 16 == 0, "buffer bytes % sizeof(int4) == 0")
    signaling = _align(E * 4, 128)
    return 2 * send + 2 * recv + 2 * signaling


# ---------------------------------------------------------------------------- transport


def _rows_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[n, ...]` contiguous → `[n, bytes_per_row]` uint8 view (gloo moves any dtype as bytes)."""
    t = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_rows: list[int] | None, in_rows: list[int] | None, group):
    return dist.all_to_all_single(
        _rows_as_bytes(out), _rows_as_bytes(inp.contiguous()), out_rows, in_rows, group=group, async_op=True
    )


def _fill_stale(t: torch.Tensor, options: EmulationOptions) -> torch.Tensor:
    if options.poison:
        if t.dtype == _FP8:
            t.view(torch.uint8).fill_(0x60)  # a finite fp8 value (8.0)
        elif t.is_floating_point():
            t.fill_(_STALE)
        else:
            t.fill_(-1)
    return t


def _low_latency_cast_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token, per-128-channel e4m3 cast: `(q [N, H], scale_inv [N, H/128])`."""
    groups = x.float().unflatten(-1, (x.shape[-1] // 128, 128))
    amax = groups.abs().amax(dim=-1).clamp(min=_FP8_MARGIN)
    scale_inv = amax / _FP8_AMAX
    if round_scale:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
        scale = 1.0 / scale_inv
    else:
        scale = _FP8_AMAX / amax
    q = (groups * scale.unsqueeze(-1)).clamp(-_FP8_AMAX, _FP8_AMAX).to(_FP8)
    return q.flatten(-2), scale_inv


def _pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales `[..., G]` → their exponent bytes, four per int32 `[..., G/4]`."""
    exponents = (scale_inv.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    return exponents.view(torch.int32)


# ---------------------------------------------------------------------------- buffer


class Buffer:
    """`deep_ep.Buffer` on torch.distributed: see the module docstring for the contract."""

    num_sms: int = 20
    _options: EmulationOptions = EmulationOptions()
    #: the live NVSHMEM-initialising Buffers of this install (weakly held).
    _nvshmem_buffers: "weakref.WeakSet[Buffer]" = weakref.WeakSet()

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ) -> None:
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            raise NotImplementedError("deep_ep (emulated): an mpi4py `comm` is not supported, pass a process group")
        self.rank = group.rank()
        self.group_size = group.size()
        self.group = group
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        R = self.group_size
        _host_assert(
            num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0 and (num_nvl_bytes <= _INT_MAX or num_rdma_bytes == 0),
            "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0 and (num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0)",
        )
        _host_assert(
            num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0 and (low_latency_mode or num_rdma_bytes <= _INT_MAX),
            "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0 and (low_latency_mode or num_rdma_bytes <= INT_MAX)",
        )
        _host_assert(
            0 <= self.rank < R and (R <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode),
            "0 <= rank < num_ranks and (num_ranks <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode)",
        )
        _host_assert(
            R < NUM_MAX_NVL_PEERS or R % NUM_MAX_NVL_PEERS == 0,
            "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0",
        )
        if num_rdma_bytes > 0:
            _host_assert(R > NUM_MAX_NVL_PEERS or low_latency_mode, "num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode")
        if R > NUM_MAX_NVL_PEERS or low_latency_mode:
            assert num_qps_per_rank > 0
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", str(DEFAULT_NVSHMEM_QP_DEPTH)))
            # NVSHMEM is initialised once per process: DeepEP's second low-latency Buffer fails
            # `nvshmem::init`'s host assert beyond 8 ranks and costs another full RDMA buffer below.
            live = [b for b in type(self)._nvshmem_buffers if not b._destroyed]
            _host_assert(
                not live,
                "one NVSHMEM (low-latency) Buffer per process: a second one re-runs nvshmem::init "
                "(share one Buffer between layers and ubatches, or destroy() the first)",
            )
            type(self)._nvshmem_buffers.add(self)
        # The real constructor exchanges device ids, IPC and NVSHMEM handles: a collective.
        peers: list = [None] * R
        dist.all_gather_object(peers, self.rank, group)
        self._ll_buffer_idx = 0
        self._ll_in_flight: list[_Transfer | None] = [None, None]
        self._ll_combine_buffers: dict = {}
        self._lock = threading.Lock()
        self._destroyed = False

    # -------------------------------------------------------------- static helpers

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._destroyed = True
        type(self)._nvshmem_buffers.discard(self)

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        cls.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        total = _low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES

    # DeepEP's recommended intranode chunking (nvl send, nvl recv, rdma send, rdma recv tokens)
    # with `num_sms` SMs; internode group sizes are not emulated.
    _DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
    _COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        assert num_ranks in cls._DISPATCH_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(cls.num_sms, *cls._DISPATCH_CONFIGS[num_ranks])

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        assert num_ranks in cls._COMBINE_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(cls.num_sms, *cls._COMBINE_CONFIGS[num_ranks])

    # -------------------------------------------------------------- shared checks

    def _check_alive(self) -> None:
        _host_assert(not self._destroyed, "the buffer has been destroyed")

    def _check_topk_idx_dtype(self, topk_idx: torch.Tensor) -> None:
        wanted = self._options.topk_idx_dtype
        _host_assert(
            topk_idx.dtype == wanted,
            f"topk_idx.scalar_type() == deep_ep.topk_idx_t ({wanted}, got {topk_idx.dtype})",
        )

    def _check_compute_dtype(self, x: torch.Tensor, what: str) -> None:
        allowed = (torch.bfloat16, torch.float32) if self._options.allow_float32 else (torch.bfloat16,)
        _host_assert(x.dtype in allowed, f"{what}.scalar_type() == torch::kBFloat16 (got {x.dtype})")

    @staticmethod
    def _wait_previous(
        previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool
    ) -> None:
        if allocate_on_comm_stream:
            _host_assert(previous_event is not None and async_finish, "previous_event.has_value() and async")
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()

    @staticmethod
    def _finish(transfer: _Transfer, async_finish: bool, extra_tensors: tuple | None = None) -> EventOverlap:
        if async_finish:
            return EventOverlap(EventHandle(transfer), extra_tensors)
        transfer.complete()
        return EventOverlap(None)

    def _check_expert_ids(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        # Not checked by DeepEP (an out-of-range id corrupts memory there); an error here.
        bad = (topk_idx < -1) | (topk_idx >= num_experts)
        if bool(bad.any()):
            raise ValueError(
                f"deep_ep (emulated): top-k ids must lie in [-1, {num_experts}), got {topk_idx[bad][:4].tolist()}"
            )

    def _require_intranode(self) -> None:
        if self.group_size > NUM_MAX_NVL_PEERS:
            raise NotImplementedError(
                "deep_ep (emulated): internode (> 8 ranks) high-throughput kernels are not emulated"
            )
        _host_assert(self.group_size in (2, 4, 8), "Unsupported number of ranks (intranode kernels take 2, 4 or 8)")

    # -------------------------------------------------------------- high throughput

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        R = self.group_size
        _check_matrix(topk_idx, "topk_idx")
        self._check_topk_idx_dtype(topk_idx)
        _host_assert(num_experts > 0 and num_experts % R == 0, "num_experts > 0 and num_experts % num_ranks == 0")
        self._check_expert_ids(topk_idx, num_experts)
        self._wait_previous(previous_event, async_finish, allocate_on_comm_stream)
        valid = topk_idx >= 0
        ids = topk_idx.clamp(min=0).long()
        num_tokens_per_expert = (F.one_hot(ids, num_experts) * valid.unsqueeze(-1)).sum(dim=(0, 1)).to(torch.int32)
        dest = torch.where(valid, ids // (num_experts // R), -1)
        is_token_in_rank = (dest.unsqueeze(-1) == torch.arange(R)).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        event = EventOverlap(EventHandle() if async_finish else None)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event

    def _ht_nvl_bytes_needed(self, config: Config, hidden: int, elem: int, num_topk: int, num_scales: int) -> int:
        R, C, chunk = self.group_size, config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        return (
            R * R * 4
            + C * R * 4 * 4
            + C * R * chunk * (hidden * elem + 4 + num_topk * 8 + num_topk * 4 + num_scales * 4)
        )

    def dispatch(
        self,
        x,
        handle: Optional[tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        self._require_intranode()
        if num_worst_tokens:
            raise NotImplementedError("deep_ep (emulated): num_worst_tokens is not emulated")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        R, me, group = self.group_size, self.rank, self.group
        cached = handle is not None
        if cached:
            assert topk_idx is None and topk_weights is None
            (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
             recv_src_idx, is_token_in_rank, send_head) = handle
        else:
            assert num_tokens_per_rank is not None and is_token_in_rank is not None
            assert num_tokens_per_expert is not None

        # Host checks of the intranode dispatch.
        _host_assert(is_token_in_rank.dtype == torch.bool, "is_token_in_rank.scalar_type() == torch::kBool")
        _host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        _host_assert(x.shape[1] * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        _check_matrix(is_token_in_rank, "is_token_in_rank")
        _host_assert(
            tuple(is_token_in_rank.shape) == (x.shape[0], R),
            "is_token_in_rank.size(0) == x.size(0) and is_token_in_rank.size(1) == num_ranks",
        )
        num_experts = 0
        if not cached:
            _host_assert(num_tokens_per_expert.dtype == torch.int32, "num_tokens_per_expert.scalar_type() == kInt32")
            _host_assert(num_tokens_per_rank.dtype == torch.int32, "num_tokens_per_rank.scalar_type() == kInt32")
            _host_assert(
                num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.shape[0] % R == 0
                and num_tokens_per_expert.shape[0] // R <= NUM_MAX_LOCAL_EXPERTS,
                "num_tokens_per_expert is [num_experts] with num_experts % num_ranks == 0",
            )
            _host_assert(
                num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.shape[0] == R,
                "num_tokens_per_rank.size(0) == num_ranks",
            )
            num_experts = num_tokens_per_expert.shape[0]
        num_local_experts = num_experts // R
        num_topk = 0
        _host_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
        if topk_idx is not None:
            num_topk = topk_idx.shape[1]
            _host_assert(num_experts > 0, "num_experts > 0")
            _check_matrix(topk_idx, "topk_idx")
            _check_matrix(topk_weights, "topk_weights")
            _host_assert(
                topk_idx.shape[0] == x.shape[0] == topk_weights.shape[0],
                "num_tokens == topk_idx.size(0) and num_tokens == topk_weights.size(0)",
            )
            _host_assert(topk_weights.shape[1] == num_topk, "num_topk == topk_weights.size(1)")
            self._check_topk_idx_dtype(topk_idx)
            _host_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")
            self._check_expert_ids(topk_idx, num_experts)
        num_scales = 0
        if x_scales is not None:
            _host_assert(x.element_size() == 1, "x.element_size() == 1")
            _host_assert(
                x_scales.dtype in (torch.float32, torch.int32),
                "x_scales.scalar_type() == torch::kFloat32 or x_scales.scalar_type() == torch::kInt",
            )
            # Any strides: the kernel reads them through scale_token_stride / scale_hidden_stride.
            _host_assert(x_scales.dim() == 2, "x_scales.dim() == 2")
            _host_assert(x_scales.shape[0] == x.shape[0], "x_scales.size(0) == num_tokens")
            num_scales = x_scales.shape[1]
        self._wait_previous(previous_event, async_finish, allocate_on_comm_stream)

        # Rows to send: grouped by destination rank, ascending token order inside a rank.
        sent_to = [is_token_in_rank[:, r].nonzero(as_tuple=True)[0] for r in range(R)]
        send_counts = [int(idx.numel()) for idx in sent_to]
        token_index = torch.cat(sent_to)
        rank_of_row = torch.cat([torch.full_like(idx, r) for r, idx in enumerate(sent_to)])

        if cached:
            starts = torch.cat([torch.zeros(1, dtype=torch.int64), rank_prefix_matrix[:, me].long()])
            recv_counts = (starts[1:] - starts[:-1]).tolist()
        else:
            if num_tokens_per_rank.tolist() != send_counts:
                raise ValueError("deep_ep (emulated): num_tokens_per_rank disagrees with is_token_in_rank")
            _host_assert(
                R * (R + num_local_experts) * 4 <= self.num_nvl_bytes,
                "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes",
            )
            # notify_dispatch: every rank learns every rank's counts (the CPU waits for them).
            C = config.num_sms // 2
            channel_prefix_matrix = self._channel_prefix(is_token_in_rank, C)
            mine = torch.cat(
                [num_tokens_per_rank.long(), num_tokens_per_expert.long(), channel_prefix_matrix.long().flatten()]
            )
            gathered = [torch.empty_like(mine) for _ in range(R)]
            dist.all_gather(gathered, mine, group=group)
            table = torch.stack(gathered)  # [R(src), R + E + R*C]
            counts = table[:, :R]  # [src, dst]
            rank_prefix_matrix = counts.cumsum(dim=0).to(torch.int32)
            recv_counts = counts[:, me].tolist()
            per_expert = table[:, R + me * num_local_experts : R + (me + 1) * num_local_experts].sum(dim=0)
            num_recv_tokens_per_expert_list = [_align(int(n), expert_alignment) for n in per_expert.tolist()]
            sender_channels = table[:, R + num_experts :].view(R, R, C)[:, me, :]  # [src, C] inclusive prefix
            rank_start = torch.cat([torch.zeros(1, dtype=torch.int64), counts[:, me].cumsum(0)[:-1]])
            channel_start = torch.cat([torch.zeros(R, 1, dtype=torch.int64), sender_channels[:, :-1]], dim=1)
            recv_channel_prefix_matrix = (rank_start.unsqueeze(1) + channel_start).to(torch.int32)
            send_head = torch.full((x.shape[0], R), -1, dtype=torch.int32)
            for r, idx in enumerate(sent_to):
                send_head[idx, r] = torch.arange(idx.numel(), dtype=torch.int32)
        num_recv = sum(recv_counts)
        _host_assert(
            self._ht_nvl_bytes_needed(config, x.shape[1], x.element_size(), num_topk, num_scales) <= self.num_nvl_bytes,
            "the NVL buffer holds the dispatch chunks (num_nvl_bytes too small for this config)",
        )

        recv_x = _fill_stale(torch.empty((num_recv, x.shape[1]), dtype=x.dtype), self._options)
        sends, recvs = [x[token_index]], [recv_x]
        recv_x_scales = None
        if x_scales is not None:
            recv_x_scales = torch.empty((num_recv, num_scales), dtype=x_scales.dtype)
            sends.append(x_scales[token_index])
            recvs.append(recv_x_scales)
        recv_topk_idx = recv_topk_weights = None
        if not cached:
            recv_src_idx = torch.empty(num_recv, dtype=torch.int32)
            sends.append(token_index.to(torch.int32))
            recvs.append(recv_src_idx)
        if topk_idx is not None:
            rows = topk_idx[token_index]
            lo = (rank_of_row * num_local_experts).unsqueeze(1)
            local = torch.where((rows >= lo) & (rows < lo + num_local_experts), rows - lo, -1).to(topk_idx.dtype)
            weights = torch.where(local >= 0, topk_weights[token_index], 0.0)
            recv_topk_idx = torch.empty((num_recv, num_topk), dtype=topk_idx.dtype)
            recv_topk_weights = torch.empty((num_recv, num_topk), dtype=torch.float32)
            sends += [local, weights]
            recvs += [recv_topk_idx, recv_topk_weights]
        works = [_a2a(out, inp, recv_counts, send_counts, group) for inp, out in zip(sends, recvs)]
        event = self._finish(_Transfer(works), async_finish, tuple(recvs))

        recv = (recv_x, recv_x_scales) if x_scales is not None else recv_x
        if cached:
            return recv, None, None, None, None, event
        handle = (
            rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
            recv_src_idx, is_token_in_rank, send_head,
        )
        return recv, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event

    @staticmethod
    def _channel_prefix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
        """`[R, C]` int32: tokens sent to each rank by channels `0..c` (contiguous token ranges)."""
        num_tokens = is_token_in_rank.shape[0]
        per_channel = -(-num_tokens // num_channels) if num_tokens else 0
        channel_of_token = torch.arange(num_tokens) // max(per_channel, 1)
        counts = torch.zeros((is_token_in_rank.shape[1], num_channels), dtype=torch.int64)
        if num_tokens:
            counts.index_add_(1, channel_of_token, is_token_in_rank.t().long())
        return counts.cumsum(dim=1).to(torch.int32)

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: Optional[torch.Tensor] = None,
        bias=None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        config = self.get_combine_config(self.group_size) if config is None else config
        self._require_intranode()
        R, me, group = self.group_size, self.rank, self.group
        rank_prefix_matrix, _, channel_prefix_matrix, src_idx, is_token_in_rank, send_head = handle
        _host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        _host_assert(src_idx.dim() == 1 and src_idx.dtype == torch.int32, "src_idx.dim() == 1 and src_idx is int32")
        _host_assert(send_head.dim() == 2 and send_head.dtype == torch.int32, "send_head.dim() == 2, int32")
        _host_assert(
            rank_prefix_matrix.dtype == torch.int32 and tuple(rank_prefix_matrix.shape) == (R, R),
            "rank_prefix_matrix is int32 [num_ranks, num_ranks]",
        )
        _host_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        _host_assert(
            channel_prefix_matrix.dtype == torch.int32
            and tuple(channel_prefix_matrix.shape) == (R, config.num_sms // 2),
            "channel_prefix_matrix.size(1) == num_channels (dispatch and combine must use the same SM count)",
        )
        _host_assert(src_idx.shape[0] == x.shape[0], "src_idx.size(0) == num_tokens")
        _host_assert(send_head.shape[1] == R, "send_head.size(1) == num_ranks")
        _host_assert(x.shape[1] * x.element_size() % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0")
        self._check_compute_dtype(x, "x")
        num_topk = 0
        if topk_weights is not None:
            _check_matrix(topk_weights, "topk_weights")
            _host_assert(topk_weights.shape[0] == x.shape[0], "topk_weights.size(0) == num_tokens")
            _host_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")
            num_topk = topk_weights.shape[1]
        num_combined = send_head.shape[0]
        biases = [] if bias is None else list(bias) if isinstance(bias, tuple) else [bias]
        for b in biases:
            _host_assert(
                b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype
                and tuple(b.shape) == (num_combined, x.shape[1]),
                "bias is a contiguous [num_combined_tokens, hidden] tensor of x's dtype",
            )
        C, chunk = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
        _host_assert(
            C * R * 4 * 2 + C * R * chunk * (x.shape[1] * x.element_size() + 4 + num_topk * 4) <= self.num_nvl_bytes,
            "the NVL buffer holds the combine chunks (num_nvl_bytes too small for this config)",
        )
        self._wait_previous(previous_event, async_finish, allocate_on_comm_stream)

        prefix = torch.cat([torch.zeros(1, dtype=torch.int64), rank_prefix_matrix[:, me].long()])
        back_counts = (prefix[1:] - prefix[:-1]).tolist()  # rows that came from each rank go back
        sent_to = [is_token_in_rank[:, r].nonzero(as_tuple=True)[0] for r in range(R)]
        token_index = torch.cat(sent_to)
        sent_counts = [int(idx.numel()) for idx in sent_to]
        returned = torch.empty((sum(sent_counts), x.shape[1]), dtype=x.dtype)
        sends, recvs = [x], [returned]
        returned_w = None
        if topk_weights is not None:
            returned_w = torch.empty((sum(sent_counts), num_topk), dtype=torch.float32)
            sends.append(topk_weights)
            recvs.append(returned_w)
        works = [_a2a(out, inp, sent_counts, back_counts, group) for inp, out in zip(sends, recvs)]
        combined_x = _fill_stale(torch.empty((num_combined, x.shape[1]), dtype=x.dtype), self._options)
        combined_w = torch.empty((num_combined, num_topk), dtype=torch.float32) if topk_weights is not None else None

        def reduce() -> None:
            acc = torch.zeros((num_combined, x.shape[1]), dtype=torch.float32)
            acc.index_add_(0, token_index, returned.float())
            for b in biases:
                acc += b.float()
            combined_x.copy_(acc.to(x.dtype))
            if combined_w is not None:
                combined_w.zero_().index_add_(0, token_index, returned_w)

        event = self._finish(_Transfer(works, reduce), async_finish, (x, combined_x))
        return combined_x, combined_w, event

    # -------------------------------------------------------------- low latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self._check_alive()
        _host_assert(self.low_latency_mode, "low_latency_mode")

    def _claim_low_latency_slot(self) -> int:
        with self._lock:
            idx = self._ll_buffer_idx
            previous = self._ll_in_flight[idx]
            if previous is not None and not (previous.done or previous.issued):
                raise RuntimeError(
                    f"deep_ep (emulated): low-latency buffer {idx} is reused while the operation issued two "
                    "calls ago still waits for its receive hook; DeepEP keeps two buffers, so at most two "
                    "low-latency results may be outstanding (the real library would corrupt them silently)"
                )
            self._ll_buffer_idx ^= 1
            return idx

    def _check_low_latency(self, hidden: int, num_topk: int, T: int, num_experts: int) -> None:
        _host_assert(self.low_latency_mode, "low_latency_mode")
        # A Python assert in DeepEP (`buffers/legacy.py`), hence AssertionError.
        assert self.nvshmem_qp_depth >= (T + 1) * 2, (
            f"NVSHMEM_QP_DEPTH={self.nvshmem_qp_depth} < (num_max_dispatch_tokens_per_rank + 1) * 2 = {(T + 1) * 2}"
        )
        _host_assert(
            hidden in LL_SUPPORTED_HIDDEN,
            f"Unsupported hidden ({hidden}; low-latency kernels take {LL_SUPPORTED_HIDDEN})",
        )
        _host_assert(num_topk <= LL_MAX_TOPK, f"num_topk <= kNumMaxTopK ({LL_MAX_TOPK})")
        _host_assert(
            _low_latency_layout_bytes(T, hidden, self.group_size, num_experts) <= self.num_rdma_bytes,
            "layout.total_bytes <= num_rdma_bytes (size the buffer with get_low_latency_rdma_size_hint)",
        )

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        self._check_alive()
        R, T = self.group_size, num_max_dispatch_tokens_per_rank
        _host_assert(self.low_latency_mode, "low_latency_mode")
        _host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        self._check_compute_dtype(x, "x")
        _host_assert(
            x.shape[1] % 8 == 0 and x.shape[1] % 128 == 0,
            "x.size(1) % sizeof(int4) == 0 and x.size(1) % 128 == 0",
        )
        _check_matrix(topk_idx, "topk_idx")
        _host_assert(
            x.shape[0] == topk_idx.shape[0] and x.shape[0] <= T,
            "x.size(0) == topk_idx.size(0) and x.size(0) <= num_max_dispatch_tokens_per_rank "
            f"({x.shape[0]} tokens, limit {T})",
        )
        self._check_topk_idx_dtype(topk_idx)
        _host_assert(num_experts % R == 0, "num_experts % num_ranks == 0")
        El = num_experts // R
        if cumulative_local_expert_recv_stats is not None:
            s = cumulative_local_expert_recv_stats
            _host_assert(
                s.dtype == torch.int32 and s.dim() == 1 and s.is_contiguous() and s.shape[0] == El,
                "cumulative_local_expert_recv_stats is int32 [num_local_experts]",
            )
        if dispatch_wait_recv_cost_stats is not None:
            s = dispatch_wait_recv_cost_stats
            _host_assert(
                s.dtype == torch.int64 and s.dim() == 1 and s.is_contiguous() and s.shape[0] == R,
                "dispatch_wait_recv_cost_stats is int64 [num_ranks]",
            )
        _host_assert(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
        _host_assert(round_scale or not use_ue8m0, "use_ue8m0 requires round_scale")
        _host_assert(not use_fp8 or x.shape[1] % 512 == 0, f"hidden % 512 == 0 (fp8 dispatch), got hidden={x.shape[1]}")
        N, H = x.shape
        K = topk_idx.shape[1]
        self._check_low_latency(H, K, T, num_experts)
        _host_assert(
            (R * T) % 4 == 0,
            f"(num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0 and \"TMA requires the number of tokens to be "
            f"multiple of 4\" ({R} * {T})",
        )
        self._check_expert_ids(topk_idx, num_experts)
        slot = self._claim_low_latency_slot()

        # Send side: every (token, k) pair gets the next free row of its expert's T rows.
        valid = (topk_idx >= 0).flatten()
        ids = topk_idx.clamp(min=0).long().flatten()
        onehot = F.one_hot(ids, num_experts) * valid.unsqueeze(1)
        row_in_expert = ((onehot.cumsum(0) - onehot) * onehot).sum(1)
        send_rows = (ids * T + row_in_expert)[valid]  # = ((dst_rank * El) + e) * T + p
        tokens = torch.arange(N).repeat_interleave(K)[valid]
        counts = onehot.sum(0).to(torch.int32).view(R, El)
        if use_fp8:
            payload, payload_scales = _low_latency_cast_fp8(x, round_scale)
        else:
            payload, payload_scales = x, None
        send_x = torch.zeros((num_experts * T, H), dtype=payload.dtype)
        send_x.view(torch.uint8)[send_rows] = payload.view(torch.uint8)[tokens]
        send_src = torch.full((num_experts * T,), -1, dtype=torch.int32)
        send_src[send_rows] = tokens.to(torch.int32)
        send_meta = torch.cat([counts, send_src.view(R, El * T)], dim=1)
        sends = [send_meta, send_x.view(R, -1)]
        recv_meta = torch.empty_like(send_meta)
        recv_data = torch.empty((R, El * T * H), dtype=payload.dtype)
        recvs = [recv_meta, recv_data]
        if payload_scales is not None:
            send_scales = torch.zeros((num_experts * T, H // 128), dtype=torch.float32)
            send_scales[send_rows] = payload_scales[tokens]
            sends.append(send_scales.view(R, -1))
            recvs.append(torch.empty((R, El * T * (H // 128)), dtype=torch.float32))
        works = [_a2a(out, inp, None, None, self.group) for inp, out in zip(sends, recvs)]

        # Receive side: what the caller gets now and the hook/event fills in.
        opts = self._options
        packed_x = _fill_stale(torch.empty((El, R * T, H), dtype=payload.dtype), opts)
        packed_scales = None
        if use_fp8:
            if use_ue8m0:
                packed_scales = torch.zeros((El, H // 512, R * T), dtype=torch.int32).transpose(1, 2)
            else:
                column_major = torch.empty((El, H // 128, R * T), dtype=torch.float32)
                packed_scales = _fill_stale(column_major, opts).transpose(1, 2)
        packed_count = _fill_stale(torch.empty(El, dtype=torch.int32), opts)
        src_info = _fill_stale(torch.empty((El, R * T), dtype=torch.int32), opts)
        layout_range = torch.zeros((El, R), dtype=torch.int64)

        def receive() -> None:
            meta = recv_meta
            got_counts = meta[:, :El].long()  # [src, E_local]
            got_src = meta[:, El:].view(R, El, T)
            begin = got_counts.cumsum(0) - got_counts  # where src r's rows start in expert e
            keep = torch.arange(T) < got_counts.unsqueeze(-1)
            r_idx, e_idx, p_idx = keep.nonzero(as_tuple=True)
            dest = begin[r_idx, e_idx] + p_idx
            data = recv_data.view(R, El, T, H)
            packed_x.view(torch.uint8)[e_idx, dest] = data.view(torch.uint8)[r_idx, e_idx, p_idx]
            if packed_scales is not None:
                scales = recvs[2].view(R, El, T, H // 128)[r_idx, e_idx, p_idx]
                packed_scales[e_idx, dest] = _pack_ue8m0(scales) if use_ue8m0 else scales
            src_info[e_idx, dest] = got_src[r_idx, e_idx, p_idx]
            per_expert = got_counts.sum(0)
            packed_count.copy_(per_expert)
            layout_range.copy_(((begin << 32) | got_counts).t())  # low 32 bits: count, high: begin
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(per_expert.to(torch.int32))

        transfer = _Transfer(works, receive)
        self._ll_in_flight[slot] = transfer
        handle = (src_info, layout_range, T, H, num_experts)
        recv = (packed_x, packed_scales) if use_fp8 else packed_x
        if return_recv_hook:
            hook = _recv_hook(transfer, _launch_stream())
            recv = (_guarded(packed_x, transfer), _guarded(packed_scales, transfer)) if use_fp8 else _guarded(packed_x, transfer)
            return recv, _guarded(packed_count, transfer), handle, EventOverlap(None), hook
        tensors = (x, topk_idx, packed_x, packed_scales, packed_count, src_info, layout_range)
        return recv, packed_count, handle, self._finish(transfer, async_finish, tensors), None

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        src_info, layout_range, T, hidden, num_experts = handle
        key = (self._ll_buffer_idx, T, hidden, num_experts)
        if key not in self._ll_combine_buffers:
            self._ll_combine_buffers[key] = torch.zeros(
                (num_experts // self.group_size, self.group_size * T, hidden), dtype=torch.bfloat16
            )
        return self._ll_combine_buffers[key]

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
    ):
        self._check_alive()
        src_info, layout_range, T, hidden, num_experts = handle
        R = self.group_size
        El = num_experts // R
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        _host_assert(self.low_latency_mode, "low_latency_mode")
        _host_assert(x.dim() == 3 and x.is_contiguous(), "x.dim() == 3 and x.is_contiguous()")
        self._check_compute_dtype(x, "x")
        _host_assert(x.shape[0] == El, "x.size(0) == num_experts / num_ranks")
        _host_assert(x.shape[1] == R * T, "x.size(1) == num_ranks * num_max_dispatch_tokens_per_rank")
        _host_assert(
            x.shape[2] % 8 == 0 and x.shape[2] % 128 == 0,
            "x.size(2) % sizeof(int4) == 0 and x.size(2) % 128 == 0",
        )
        _check_matrix(topk_idx, "topk_idx")
        _host_assert(topk_idx.shape == topk_weights.shape, "topk_idx and topk_weights have the same shape")
        self._check_topk_idx_dtype(topk_idx)
        _check_matrix(topk_weights, "topk_weights")
        _host_assert(topk_weights.shape[0] <= T, "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank")
        _host_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")
        _host_assert(
            src_info.dim() == 2 and src_info.dtype == torch.int32 and src_info.shape[0] == x.shape[0],
            "src_info.scalar_type() == torch::kInt32 and x.size(0) == src_info.size(0)",
        )
        _host_assert(
            layout_range.dim() == 2 and layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (El, R),
            "layout_range is int64 [num_experts / num_ranks, num_ranks]",
        )
        if combine_wait_recv_cost_stats is not None:
            s = combine_wait_recv_cost_stats
            _host_assert(
                s.dtype == torch.int64 and s.dim() == 1 and s.shape[0] == R,
                "combine_wait_recv_cost_stats is int64 [num_ranks]",
            )
        _host_assert(not (async_finish and return_recv_hook), "not (async and return_recv_hook)")
        N, K = topk_idx.shape
        H = x.shape[2]
        self._check_low_latency(H, K, T, num_experts)
        self._check_expert_ids(topk_idx, num_experts)
        if out is not None:
            _check_matrix(out, "out")
            _host_assert(tuple(out.shape) == (N, H), "out.size(0) == num_combined_tokens and out.size(1) == hidden")
        slot = self._claim_low_latency_slot()

        # Send every valid row back to its source rank, at [expert, source token].
        counts = layout_range & 0xFFFFFFFF
        begin = layout_range >> 32
        keep = torch.arange(T) < counts.unsqueeze(-1)  # [E_local, R, T]
        e_idx, r_idx, p_idx = keep.nonzero(as_tuple=True)
        rows = begin[e_idx, r_idx] + p_idx
        token = src_info[e_idx, rows].long()
        send = torch.zeros((R, El, T, H), dtype=x.dtype)
        send[r_idx, e_idx, token] = x[e_idx, rows]
        received = torch.empty_like(send)
        works = [_a2a(received.view(R, -1), send.view(R, -1), None, None, self.group)]
        combined_x = out if out is not None else _fill_stale(torch.empty((N, H), dtype=x.dtype), self._options)

        # The receive reads topk_idx and topk_weights through raw pointers: DeepEP keeps no
        # reference to them in hook mode, so the caller must keep them alive until it ran.
        idx_ref, weights_ref = weakref.ref(topk_idx), weakref.ref(topk_weights)

        def receive() -> None:
            topk_idx, topk_weights = idx_ref(), weights_ref()
            if topk_idx is None or topk_weights is None:
                raise RuntimeError(
                    "deep_ep (emulated): the topk_idx/topk_weights given to low_latency_combine were freed before "
                    "its receive ran (the real kernel reads them then: their memory may already be reused); keep "
                    "them alive until the receive hook has run"
                )
            by_expert = received.view(num_experts, T, H)  # row [global expert, my token]
            valid = topk_idx >= 0
            rows = by_expert[topk_idx.clamp(min=0).long(), torch.arange(N).unsqueeze(1)].float()
            rows = torch.where(valid.unsqueeze(-1), rows, 0.0)
            weights = (topk_weights * valid).unsqueeze(-1)
            combined_x.copy_((rows * weights).sum(1).to(combined_x.dtype))

        transfer = _Transfer(works, receive)
        self._ll_in_flight[slot] = transfer
        if return_recv_hook:
            return _guarded(combined_x, transfer), EventOverlap(None), _recv_hook(transfer, _launch_stream())
        tensors = (x, topk_idx, topk_weights, src_info, layout_range, combined_x)
        return combined_x, self._finish(transfer, async_finish, tensors), None


# ---------------------------------------------------------------------------- install


def install(
    *, allow_float32: bool = False, poison: bool = True, topk_idx_dtype: torch.dtype = torch.int64
) -> types.ModuleType:
    """Register a fresh emulated `deep_ep` (and `deep_ep.utils`, `deep_ep.buffer`) in
    `sys.modules`; returns the module. Options live on that module's `Buffer` class, so two
    installs never share state. `uninstall()` restores whatever was there before."""
    options = EmulationOptions(allow_float32=allow_float32, poison=poison, topk_idx_dtype=topk_idx_dtype)
    attrs = {
        "_options": options,
        "num_sms": Buffer.num_sms,
        "_nvshmem_buffers": weakref.WeakSet(),
        "__module__": "deep_ep.buffer",
    }
    buffer_cls = type("Buffer", (Buffer,), attrs)
    names = ("deep_ep", "deep_ep.utils", "deep_ep.buffer")
    previous = {name: sys.modules.get(name) for name in names}
    utils = types.ModuleType("deep_ep.utils", "emulated deep_ep.utils")
    utils.EventOverlap = EventOverlap
    utils.EventHandle = EventHandle
    buffer_mod = types.ModuleType("deep_ep.buffer", "emulated deep_ep.buffer")
    buffer_mod.Buffer = buffer_cls
    buffer_mod.Config = Config
    buffer_mod.EventOverlap = EventOverlap
    module = types.ModuleType("deep_ep", __doc__)
    module.Buffer = buffer_cls
    module.Config = Config
    module.EventOverlap = EventOverlap
    module.utils = utils
    module.buffer = buffer_mod
    module.topk_idx_t = topk_idx_dtype
    module.emulation_options = options
    module.__tandem_fake__ = True
    module._tandem_previous = previous
    sys.modules.update({"deep_ep": module, "deep_ep.utils": utils, "deep_ep.buffer": buffer_mod})
    return module


def uninstall() -> None:
    """Remove the emulated `deep_ep` put there by `install()` (a real one is left alone)."""
    module = sys.modules.get("deep_ep")
    if module is None or not getattr(module, "__tandem_fake__", False):
        return
    for name, prev in module._tandem_previous.items():
        if prev is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = prev


@contextlib.contextmanager
def installed(
    *, allow_float32: bool = False, poison: bool = True, topk_idx_dtype: torch.dtype = torch.int64
) -> Iterator[types.ModuleType]:
    module = install(allow_float32=allow_float32, poison=poison, topk_idx_dtype=topk_idx_dtype)
    try:
        yield module
    finally:
        uninstall()
