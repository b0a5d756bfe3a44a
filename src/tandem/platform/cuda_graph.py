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

from typing import Any, Callable

import torch

from tandem.platform.graph import Graph, GraphCaptureError, _capturing, _CaptureState, graph_capture_active


class _CudaCaptureState(_CaptureState):
    kind = "cuda"


class CudaGraph(Graph):
    capture_computes_outputs = False

    def __init__(self, pool: Any = None, warmup_runs: int = 1) -> None:
        self._pool = pool
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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self._warmup_runs):
                fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with _capturing(_CudaCaptureState()), torch.cuda.graph(graph, pool=self._pool, stream=side):
                out = fn(*args, **kwargs)
        except RuntimeError as exc:
            if "capture" in str(exc).lower():
                raise GraphCaptureError(
                    f"CUDA graph capture failed: {exc}. A captured forward must not sync with the host "
                    "(.item(), .tolist(), data-dependent shapes, blocking collectives)."
                ) from exc
            raise
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
