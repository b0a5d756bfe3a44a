"""The kernel counter `tandem profile` and the fake-CUDA kernels-per-layer test share, and
the shape arithmetic behind the profile's byte and FLOP columns."""

import pytest
import torch
from torch import nn

from tandem.bench.op_count import OpCounter, count_ops_per_layer, launches_kernel
from tandem.bench.step_cost import StepShape, tensor_bytes


def test_views_and_allocations_are_no_kernels():
    x = torch.randn(4, 8)
    with OpCounter() as counter:
        y = x.view(8, 4).t().transpose(0, 1)  # three views
        torch.empty(3)
        z = (y @ y.T).relu()  # mm, relu
    assert counter.total == 2 and counter.by_op == {"mm": 1, "relu": 1}
    assert z.shape == (8, 8)
    assert not launches_kernel(torch.ops.aten.view.default) and launches_kernel(torch.ops.aten.add.Tensor)


def test_scopes_are_inclusive_and_must_nest():
    counter = OpCounter()
    x = torch.ones(3)
    with counter:
        with counter.scope("outer"):
            x + 1
            with counter.scope("inner"):
                x * 2
                x * 3
    assert counter.by_scope == {"outer": 3, "inner": 2}
    counter.enter("a")
    with pytest.raises(RuntimeError, match="innermost"):
        counter.leave("b")


def test_count_ops_per_layer_counts_each_layer_of_a_stack():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU())])

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x)
            return x

    model, x = Stack(), torch.randn(2, 4)
    per_layer, counter = count_ops_per_layer(model, lambda: model(x))
    assert per_layer == [1, 2]  # addmm; addmm + relu
    assert counter.total == 3


def test_attention_pairs_follow_causality():
    # 3 new tokens after 5 cached: they see 6, 7, 8 keys; one decode token after 9 sees 10.
    shape = StepShape(new_tokens=[3, 1], cached_tokens=[5, 9])
    assert shape.attention_pairs == 6 + 7 + 8 + 10
    assert shape.kv_tokens_read == 8 + 10
    assert tensor_bytes((torch.empty(2, 3), [torch.empty(4, dtype=torch.bfloat16)], "x")) == 24 + 8
