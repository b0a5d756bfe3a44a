"""The step path: planning returns a frozen `StepPlan`, running and observing take it, and
nothing about the step is parked on the runner or flipped on the model's kernels."""

import dataclasses
import pickle

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
from tandem.contexts import get_forward_context
from tandem.worker.step_inputs import ScheduledChunk
from tandem.worker.build import build_runner
from tandem.worker.sampling import SamplingParams
from tandem.worker.step_plan import StepPlan


def _runner(*, sbo: bool, **overlap):
    config = EngineConfig(
        model="tiny-moe",
        overlap=OverlapConfig(**overlap),
        parallel=ParallelConfig(enable_sbo=sbo),
        cache=CacheConfig(num_kv_blocks=64, block_size=4),
    )
    return build_runner(config)


def _kernels(runner):
    return [m.kernel for m in runner.model.modules() if hasattr(getattr(m, "kernel", None), "enable_sbo")]


def _chunks(runner, lengths):
    return [ScheduledChunk(list(range(3, 3 + n)), 0, runner.allocator.allocate(4)) for n in lengths]


def _record_contexts(runner):
    seen = []
    model_forward = runner.wrapper.model.forward

    def forward(*args, **kwargs):
        seen.append(get_forward_context())
        return model_forward(*args, **kwargs)

    runner.wrapper.model.forward = forward
    return seen


def test_a_plan_is_a_frozen_value_that_planning_alone_does_not_act_on():
    runner = _runner(sbo=False, enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0)
    chunks = _chunks(runner, [5, 3])
    plan = runner.plan_step(chunks)
    assert (plan.num_tokens, plan.num_tokens_padded, plan.num_ubatches) == (8, 8, 2)
    assert [s.token_slice for s in plan.ubatch_slices] == [slice(0, 4), slice(4, 8)]
    assert plan.tbo_decode is None and plan.sbo is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens_padded = 16
    # It travels between pipeline stages as it is.
    assert pickle.loads(pickle.dumps(plan)) == plan
    # Planning again gives the same plan: nothing was parked on the runner in between.
    assert runner.plan_step(chunks) == plan
    assert runner.steps == 0 and not hasattr(runner, "step_extras") and not hasattr(runner, "_planned")


def test_the_forward_runs_the_plan_it_is_given():
    runner = _runner(sbo=False, enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0)
    chunks = _chunks(runner, [5, 3])
    split = runner.plan_step(chunks)
    whole = dataclasses.replace(split, ubatch_slices=None)
    outputs = {}
    for name, plan in {"split": split, "whole": whole}.items():
        inputs = runner.step_inputs(chunks, plan)
        seen = _record_contexts(runner)
        with torch.no_grad():
            outputs[name] = runner.forward(inputs.input_ids, inputs, plan)
        runner.wrapper.model.forward = type(runner.wrapper.model).forward.__get__(runner.wrapper.model)
        assert len(seen) == plan.num_ubatches
    assert (runner.steps, runner.ubatched_steps) == (2, 1)
    torch.testing.assert_close(outputs["split"], outputs["whole"], rtol=1e-4, atol=1e-4)


def test_the_sbo_choice_travels_with_the_step_not_on_the_kernels():
    runner = _runner(sbo=True, enable_dbo=False, overlap_policy="auto")
    kernels = _kernels(runner)
    assert kernels and all(k.enable_sbo for k in kernels)
    chunks = _chunks(runner, [6])
    plan = runner.plan_step(chunks)
    assert plan.sbo in (True, False) and plan.planned is not None and plan.planned.choice.sbo == plan.sbo
    off = dataclasses.replace(plan, sbo=False)
    inputs = runner.step_inputs(chunks, off)
    seen = _record_contexts(runner)
    with torch.no_grad():
        runner.forward(inputs.input_ids, inputs, off)
    assert [c.sbo for c in seen] == [False]
    # The kernels keep their configuration; under the step's context they follow the step.
    assert all(k.enable_sbo for k in kernels)
    from tandem.contexts import set_forward_context

    with set_forward_context(off.forward_context(inputs.attn_metadata)):
        assert not any(k.sbo_enabled() for k in kernels)
    assert all(k.sbo_enabled() for k in kernels)  # outside a step: their own setting


def test_execute_observes_the_plan_it_ran():
    runner = _runner(sbo=True, enable_dbo=True, overlap_policy="auto", dbo_decode_token_threshold=0,
                     dbo_prefill_token_threshold=0)
    params = SamplingParams(max_tokens=1)
    for lengths in ([4, 2], [1, 1], [7]):
        runner.execute(_chunks(runner, lengths), [params] * len(lengths), [None] * len(lengths))
    stats = runner.planner.stats
    assert sum(stats.choices.values()) == 3 == runner.steps
    assert all(k.enable_sbo for k in _kernels(runner))


def test_an_idle_rank_plans_nothing_to_learn():
    runner = _runner(sbo=False, overlap_policy="auto")
    plan = runner.plan_step([])
    assert plan == StepPlan(num_tokens=0, num_tokens_padded=0, sbo=False)


@pytest.mark.parametrize("compiles", [True, False])
def test_an_engine_warms_up_compiling_backends_with_one_unsplit_uncounted_step(compiles):
    from tandem.engine.core import Engine

    runner = _runner(sbo=False, enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0)
    kernel = _kernels(runner)[0]
    kernel.experts.compiles_on_first_use = compiles  # as Triton / DeepGEMM experts declare
    seen = _record_contexts(runner)
    Engine(runner)
    if compiles:
        # Outside DBO (no ubatch slices, so no stall watchdog), one padding token, not a step.
        assert len(seen) == 1 and seen[0].ubatch_slices is None and runner.wrapper.ubatched_runs == 0
    else:
        assert seen == []
    assert runner.steps == 0
