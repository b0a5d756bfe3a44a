"""`--device` / `--dtype` resolution and the process-group backends that follow the device."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.platform import GraphCaptureError, get_platform
from tandem.platform.device import (
    DeviceUnavailableError,
    device_group_backend,
    resolve_device,
    resolve_dtype,
)


def test_auto_device_and_dtype_follow_cuda_availability():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) is torch.float16


def test_backends_follow_the_device_not_cuda_availability():
    assert device_group_backend("cpu") == "gloo"
    assert device_group_backend(torch.device("cuda", 1)) == "nccl"
    assert get_platform(torch.device("cpu")).name == "cpu"
    assert get_platform("cpu:0").name == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_one_clear_error():
    with pytest.raises(DeviceUnavailableError, match="--device cuda: CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(DeviceUnavailableError):
        EngineConfig(device="cuda")


def test_bad_flag_values_are_named():
    with pytest.raises(ValueError, match="--device must be one of"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        EngineConfig(dtype="int8")


def test_cpu_graph_refuses_an_empty_capture():
    graph = get_platform("cpu").new_graph()
    with pytest.raises(GraphCaptureError, match="recorded no ops"):
        graph.capture(lambda: None)
    assert not graph.captured
    # A capture that records work still succeeds after a refused one.
    x = torch.ones(3)
    out = graph.capture(lambda: x * 2)
    x.fill_(4.0)
    assert graph.replay() is out and out.tolist() == [8.0, 8.0, 8.0]


def test_cuda_capture_check_refuses_work_that_never_reached_the_gpu():
    """The rule CudaGraph applies after a capture (run here without a GPU): tensor outputs
    none of which is on CUDA, or torch's empty-graph warning, mean nothing was recorded."""
    import warnings

    from tandem.platform.cuda_graph import _refuse_empty_capture

    class Graph:
        was_reset = False

        def reset(self):
            self.was_reset = True

    graph = Graph()
    with pytest.raises(GraphCaptureError, match=r"recorded no CUDA work \(outputs on cpu\)"):
        _refuse_empty_capture(graph, (torch.ones(2), [torch.zeros(1)]), [])
    assert graph.was_reset
    empty = warnings.WarningMessage(UserWarning("The CUDA Graph is empty. This usually means..."), UserWarning, "x", 1)
    with pytest.raises(GraphCaptureError):
        _refuse_empty_capture(Graph(), None, [empty])
    _refuse_empty_capture(Graph(), None, [])  # in-place work with no outputs: nothing to judge by
