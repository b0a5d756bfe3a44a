"""The operations API (TBO): stage order against SGLang's executor, outputs against the
non-overlapped run, per-ubatch state and forward context, errors."""

from __future__ import annotations

import pytest

import tandem
from tandem.contexts import (
    ExecutionOperation,
    ForwardContext,
    YieldOperation,
    dbo_current_ubatch_id,
    dbo_enabled,
    execute_operations,
    execute_overlapped_operations,
    get_forward_context,
)
from tandem.contexts.operations import OperationsStrategy, to_stages


def recording_ops(log: list, num_stages: int, ops_per_stage: int = 2) -> list:
    """`num_stages` stages of `ops_per_stage` operations that log (ubatch, stage, op)
    and add their position to a running value carried through the inputs and the state."""
    ops = []
    for s in range(num_stages):
        for o in range(ops_per_stage):

            def op(state, *, mb, value, s=s, o=o):
                log.append((mb, s, o))
                state.setdefault("seen", []).append((s, o))
                return {"mb": mb, "value": value * 3 + s * 10 + o}

            ops.append(ExecutionOperation(f"s{s}o{o}", op))
        if s < num_stages - 1:
            ops.append(YieldOperation())
    return ops


def sglang_order(num_stages: int, delta: int) -> list[tuple[int, int]]:
    """(ubatch, stage) in the order SGLang's `execute_overlapped_operations` runs two
    ubatches: A alone for `delta` stages, A and B alternating, B alone at the end."""
    order, a, b = [], 0, 0
    for _ in range(delta):
        order.append((0, a)); a += 1  # noqa: E702
    for _ in range(num_stages - delta):
        order.append((0, a)); a += 1  # noqa: E702
        order.append((1, b)); b += 1  # noqa: E702
    for _ in range(delta):
        order.append((1, b)); b += 1  # noqa: E702
    return order


def stage_order(log: list) -> list[tuple[int, int]]:
    out = []
    for mb, s, _ in log:
        if not out or out[-1] != (mb, s):
            out.append((mb, s))
    return out


def test_public_names_are_reexported_from_tandem():
    for name in ("YieldOperation", "ExecutionOperation", "execute_operations", "execute_overlapped_operations"):
        assert getattr(tandem, name) is getattr(tandem.contexts, name)


@pytest.mark.parametrize("num_stages, delta", [(11, 2), (6, 2), (3, 0), (7, 0), (4, 4)])
def test_two_ubatches_run_stages_in_sglangs_order(num_stages, delta):
    log: list = []
    ops = recording_ops(log, num_stages)
    execute_overlapped_operations([{"mb": 0, "value": 1}, {"mb": 1, "value": 2}], [ops, ops], [0, delta])
    assert stage_order(log) == sglang_order(num_stages, delta)
    # Within a stage the operations run back to back, in list order.
    assert [o for _, _, o in log] == [0, 1] * (2 * num_stages)


def test_delta_two_explicit_order():
    log: list = []
    ops = recording_ops(log, 4, ops_per_stage=1)
    execute_overlapped_operations([{"mb": 0, "value": 0}, {"mb": 1, "value": 0}], [ops, ops], [0, 2])
    assert stage_order(log) == [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (1, 1), (1, 2), (1, 3)]


def test_delta_zero_explicit_order():
    log: list = []
    ops = recording_ops(log, 3, ops_per_stage=1)
    execute_overlapped_operations([{"mb": 0, "value": 0}, {"mb": 1, "value": 0}], [ops, ops], [0, 0])
    assert stage_order(log) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_outputs_equal_the_non_overlapped_run_and_state_is_per_ubatch():
    log: list = []
    ops = recording_ops(log, 5)
    inputs = [{"mb": i, "value": v} for i, v in enumerate((1, 7, -4))]
    overlapped = execute_overlapped_operations(inputs, [ops] * 3, [0, 1, 3])
    alone = [execute_operations(dict(x), ops) for x in inputs]
    assert overlapped == alone
    # Three ubatches: each starts once ubatch 0 has run its delta, then one stage
    # each per round in ubatch order; a finished one drops out.
    assert stage_order(log[: len(log) // 2]) == [
        (0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (0, 3), (1, 2), (2, 0), (0, 4), (1, 3), (2, 1), (1, 4), (2, 2), (2, 3), (2, 4)
    ]


def test_ubatches_may_have_different_operation_lists():
    log: list = []
    short, long = recording_ops(log, 2), recording_ops(log, 4)
    out = execute_overlapped_operations([{"mb": 0, "value": 0}, {"mb": 1, "value": 0}], [long, short], [0, 1])
    assert stage_order(log) == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (0, 3)]
    assert out[1] == execute_operations({"mb": 1, "value": 0}, short)


def test_state_lives_across_stages_of_one_ubatch_only():
    def send(state, *, x):
        state["in_flight"] = x * 2
        return {}

    def receive(state):
        return {"x": state.pop("in_flight") + 1}

    ops = [send, YieldOperation(), receive]
    assert execute_overlapped_operations([{"x": 1}, {"x": 10}], [ops, ops], [0, 1]) == [{"x": 3}, {"x": 21}]
    assert execute_operations({"x": 5}, ops) == {"x": 11}


def test_bare_callables_become_operations_named_after_them():
    def attention_prepare(state, **inputs):
        return inputs

    stages = to_stages([attention_prepare, YieldOperation(), lambda state: {}, YieldOperation()])
    assert [[op.debug_name for op in stage] for stage in stages] == [
        ["test_bare_callables_become_operations_named_after_them.<locals>.attention_prepare"],
        ["test_bare_callables_become_operations_named_after_them.<locals>.<lambda>"],
    ]
    assert all(isinstance(op, ExecutionOperation) for stage in stages for op in stage)


def test_each_ubatch_sees_its_forward_context_and_id():
    seen = []

    def probe(state, **inputs):
        seen.append((inputs["mb"], get_forward_context().extras["name"], dbo_current_ubatch_id(), dbo_enabled()))
        return inputs

    ops = [probe, YieldOperation(), probe]
    contexts = [ForwardContext(extras={"name": "a"}), ForwardContext(extras={"name": "b"})]
    outer = ForwardContext(extras={"name": "outer"})
    from tandem.contexts import set_forward_context

    with set_forward_context(outer):
        execute_overlapped_operations([{"mb": 0}, {"mb": 1}], [ops, ops], [0, 0], forward_contexts=contexts)
        assert get_forward_context() is outer
    assert seen == [(0, "a", 0, False), (1, "b", 1, False), (0, "a", 0, False), (1, "b", 1, False)]
    assert dbo_current_ubatch_id() == 0


def test_an_exception_names_the_ubatch_and_stage_and_the_executor_stays_usable():
    def ok(state, **inputs):
        return inputs

    def boom(state, *, mb):
        if mb == 1:
            raise RuntimeError("expert GEMM failed")
        return {"mb": mb}

    ops = [ok, YieldOperation(), ExecutionOperation("experts", boom), YieldOperation(), ok]
    with pytest.raises(RuntimeError, match="expert GEMM failed") as info:
        execute_overlapped_operations([{"mb": 0}, {"mb": 1}], [ops, ops], [0, 1])
    assert "in ubatch 1, stage 1 (experts)" in info.value.__notes__
    assert dbo_current_ubatch_id() == 0
    assert execute_overlapped_operations([{"mb": 0}, {"mb": 2}], [ops, ops], [0, 1]) == [{"mb": 0}, {"mb": 2}]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(inputs_arr=[{}], operations_arr=[[lambda s: {}]], delta_stages=[0]), "at least 2 ubatches"),
        (dict(inputs_arr=[{}, {}], operations_arr=[[lambda s: {}]] * 2, delta_stages=[1, 0]), r"delta_stages\[0\] must be 0"),
        (dict(inputs_arr=[{}, {}], operations_arr=[[lambda s: {}]] * 2, delta_stages=[0, 2]), "outside"),
        (dict(inputs_arr=[{}, {}], operations_arr=[[lambda s: {}]], delta_stages=[0, 0]), "one of each"),
        (dict(inputs_arr=[{}, {}], operations_arr=[[YieldOperation()]] * 2, delta_stages=[0, 0]), "empty stage"),
        (dict(inputs_arr=[{}, {}], operations_arr=[[42]] * 2, delta_stages=[0, 0]), "expected a YieldOperation"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        execute_overlapped_operations(**kwargs)


@pytest.mark.parametrize("executor", ["thread", "greenlet"])
def test_under_dbo_executors_a_yield_operation_is_a_dbo_yield(executor):
    log: list = []
    ops = recording_ops(log, 3, ops_per_stage=1)
    outputs = tandem.run_ubatches(
        [lambda i=i: execute_operations({"mb": i, "value": i}, ops) for i in range(2)], executor=executor
    )
    assert stage_order(log) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert outputs == [execute_operations({"mb": i, "value": i}, ops) for i in range(2)]


def test_strategies_concatenate_only_with_one_delta():
    a = OperationsStrategy([lambda s: {}], 2)
    assert len(OperationsStrategy.concat([a, a]).operations) == 2
    with pytest.raises(ValueError, match="different delta_stages"):
        OperationsStrategy.concat([a, OperationsStrategy([], 0)])
