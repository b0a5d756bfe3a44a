"""CUDA platform over `torch.cuda` streams and events."""

from __future__ import annotations

import torch

from tandem.platform.base import Event, Platform


class CudaEvent(Event):
    def __init__(self) -> None:
        self._event = torch.cuda.Event()

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        self._event.record(stream if stream is not None else torch.cuda.current_stream())

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        (stream if stream is not None else torch.cuda.current_stream()).wait_event(self._event)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaPlatform(Platform):
    name = "cuda"
    # torch keeps the current CUDA stream per OS thread.
    stream_is_thread_state = True

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def set_stream(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(stream)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def use_device(self, device: torch.device) -> torch.cuda.device:
        # The current device is per OS thread: a forward worker thread starts on cuda:0.
        return torch.cuda.device(device)

    def prepare_stream_for_capture(self, stream: torch.cuda.Stream) -> None:
        # cuBLAS keeps a handle per thread and a workspace per (handle, stream); creating
        # them allocates, which a capture must not do. vLLM's ubatch threads do the same
        # before capturing (`torch.cuda.current_blas_handle()` on compute and comm streams).
        with torch.cuda.stream(stream):
            torch.cuda.current_blas_handle()

    def new_event(self) -> CudaEvent:
        return CudaEvent()

    def new_graph(self):
        from tandem.platform.cuda_graph import CudaGraph

        if not hasattr(self, "_pool"):
            # One pool for every graph: they never replay at the same time, so they can
            # share memory (as vLLM's graphs of different sizes do). And one capture stream:
            # the caching allocator keeps blocks per stream, so graphs sharing a pool must be
            # captured on the same stream to reuse each other's memory (torch.cuda.graph's docs).
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream()
        return CudaGraph(pool=self._pool, stream=self._capture_stream)
