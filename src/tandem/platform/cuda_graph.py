"""`CudaGraph`: the `Graph` contract over `torch.cuda.CUDAGraph`.

Capture runs on a side stream (CUDA refuses capture on the legacy default stream) after a
warm-up run there, so lazy initialisation (cuBLAS handles, allocator growth, autotuning)
happens outside the capture. DBO ubatch workers issue their kernels on their own streams;
`UBatchContext` forks those streams from the current one with events, which pulls them into
the capture, and the capture ends only after the workers have joined back.

Not exercised on this project's machines (no GPU): the same contract is tested through
`CpuGraph`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from tandem.platform.graph import Graph, GraphCaptureError, _capturing, _CaptureState, graph_capture_active


def _refuse_empty_capture(graph: torch.cuda.CUDAGraph, out: Any, caught: list) -> None:
    """PyTorch only warns when a capture recorded no CUDA work, and instantiates the empty
    graph: every replay would then return the capture step's stale outputs. Refuse it: the
    warning, or tensor outputs none of which is on a CUDA device (the callable ran on CPU
    tensors), means nothing was recorded."""
    empty_warning = any("graph is empty" in str(w.message).lower() for w in caught)
    tensors = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
    off_device = bool(tensors) and not any(t.is_cuda for t in tensors)
    if empty_warning or off_device:
        graph.reset()
        where = sorted({str(t.device) for t in tensors}) if tensors else []
        raise GraphCaptureError(
            "the CUDA graph capture recorded no CUDA work (outputs on "
            f"{', '.join(where) or 'no device'}): a replay would do nothing and return stale outputs. "
            "The model, its inputs and its metadata must live on the GPU (--device cuda)."
        )


class _CudaCaptureState(_CaptureState):
    kind = "cuda"


class CudaGraph(Graph):
    capture_computes_outputs = False

    def __init__(self, pool: Any = None, warmup_runs: int = 1, stream: Any = None) -> None:
        self._pool = pool
        #: the stream warm-up and capture run on (shared by the graphs of a pool); own if None
        self._stream = stream
        self._warmup_runs = warmup_runs
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None
        self.num_replays = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def outputs(self) -> Any:
        if self._graph is None:
            raise RuntimeError("this CudaGraph has not been captured (or its capture failed)")
        return self._outputs

    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._graph is not None:
            raise RuntimeError("this CudaGraph is already captured; call reset() to capture again")
        if graph_capture_active():
            raise RuntimeError("graph captures cannot be nested")
        side = self._stream if self._stream is not None else torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self._warmup_runs):
                fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        previous = torch.cuda.current_stream()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with _capturing(_CudaCaptureState()), torch.cuda.graph(graph, pool=self._pool, stream=side):
                    out = fn(*args, **kwargs)
        except RuntimeError as exc:
            # torch.cuda.graph's __exit__ skips restoring the stream when capture_end raises:
            # put this thread back on its own stream, or later eager work runs on `side`.
            torch.cuda.set_stream(previous)
            if "capture" in str(exc).lower():
                raise GraphCaptureError(
                    f"CUDA graph capture failed: {exc}. A captured forward must not sync with the host "
                    "(.item(), .tolist(), data-dependent shapes, blocking collectives)."
                ) from exc
            raise
        except BaseException:
            torch.cuda.set_stream(previous)
            raise
        for warning in caught:
            if "graph is empty" not in str(warning.message).lower():
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        _refuse_empty_capture(graph, out, caught)
        self._graph, self._outputs = graph, out
        return out

    def replay(self) -> Any:
        if self._graph is None:
            raise RuntimeError("this CudaGraph has not been captured (or its capture failed)")
        self._graph.replay()
        self.num_replays += 1
        return self._outputs

    def reset(self) -> None:
        if self._graph is not None:
            self._graph.reset()
        self._graph, self._outputs = None, None
