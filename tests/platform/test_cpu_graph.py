"""CpuGraph: replay re-runs the recorded ops on new static-input contents, writes the same
output tensors, and capture refuses host syncs with the op named."""

from __future__ import annotations

import pytest
import torch

from tandem.platform import GraphCaptureError, get_platform
from tandem.testing import run_distributed


def test_replay_recomputes_on_new_inputs_into_the_same_outputs():
    weight = torch.randn(8, 8)
    static_x = torch.randn(4, 8)
    graph = get_platform("cpu").new_graph()
    out = graph.capture(lambda x: torch.relu(x @ weight).sum(-1, keepdim=True) + x[:, :1], static_x)
    torch.testing.assert_close(out, torch.relu(static_x @ weight).sum(-1, keepdim=True) + static_x[:, :1])
    for _ in range(3):
        new_x = torch.randn(4, 8)
        static_x.copy_(new_x)
        replayed = graph.replay()
        assert replayed is out
        torch.testing.assert_close(replayed, torch.relu(new_x @ weight).sum(-1, keepdim=True) + new_x[:, :1])
    # A parameter changed in place is read live, like a CUDA graph's fixed address.
    weight.zero_()
    torch.testing.assert_close(graph.replay(), static_x[:, :1].clone())


def test_in_place_writes_to_external_buffers_replay():
    cache = torch.zeros(6)
    index, values = torch.tensor([1, 4]), torch.tensor([2.0, 3.0])
    graph = get_platform("cpu").new_graph()
    graph.capture(lambda: cache.index_copy_(0, index, values * 2))
    cache.zero_()
    values.copy_(torch.tensor([5.0, 7.0]))
    index.copy_(torch.tensor([0, 5]))
    graph.replay()
    assert cache.tolist() == [10.0, 0, 0, 0, 0, 14.0]


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda x: x * x.sum().item(), "_local_scalar_dense"),
        (lambda x: x[x > 0], "index"),
        (lambda x: x.nonzero(), "nonzero"),
        (lambda x: torch.tensor(x.tolist()), "tolist"),
        (lambda x: x * 2 if bool(x.sum() > 0) else x, "_local_scalar_dense"),
    ],
    ids=["item", "bool-mask", "nonzero", "tolist", "python-branch"],
)
def test_capture_refuses_host_syncs_naming_the_op(fn, op):
    graph = get_platform("cpu").new_graph()
    with pytest.raises(GraphCaptureError, match=op):
        graph.capture(fn, torch.randn(5))
    assert not graph.captured


def _collectives_rank(rank: int, world: int):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    graph = get_platform("cpu").new_graph()
    static = torch.full((world * 2,), float(rank))
    out = graph.capture(lambda x: funcol.all_to_all_single(x * 10, None, None, dist.group.WORLD), static)
    first = out.clone()
    static.copy_(torch.arange(world * 2, dtype=torch.float32) + 100 * rank)
    graph.replay()
    refused = None
    try:
        get_platform("cpu").new_graph().capture(lambda x: dist.all_reduce(x), torch.ones(2))
    except GraphCaptureError as exc:
        refused = str(exc)
    return first.tolist(), out.tolist(), refused


@pytest.mark.slow
def test_functional_collectives_are_recorded_and_replayed_on_gloo():
    (first0, replay0, refused0), (first1, replay1, _) = run_distributed(_collectives_rank, 2, timeout_s=90)
    assert first0 == [0.0, 0.0, 10.0, 10.0] and first1 == [0.0, 0.0, 10.0, 10.0]
    # Each rank sends its chunk r to rank r: rank 0 gets [0,1] from itself and [100,101] from rank 1.
    assert replay0 == [0.0, 10.0, 1000.0, 1010.0] and replay1 == [20.0, 30.0, 1020.0, 1030.0]
    assert refused0 is not None and "c10d" in refused0
