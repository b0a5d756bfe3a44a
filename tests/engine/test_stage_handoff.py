"""What travels between pipeline stages: the built step inputs survive the trip exactly, and a
request's sampling parameters travel once, are dropped when it finishes and are announced
again if its id comes back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.worker.sampling_states import SamplingStates
from tandem.engine.stage_handoff import (
    MicroBatchPlan, SamplingAnnouncer, input_tensors, learn_sampling, pack_inputs, prompts_to_announce, unpack_inputs,
)
from tandem.models.paged_attention import AttentionMetadata
from tandem.worker.sampling import SamplingParams
from tandem.worker.step_inputs import ScheduledChunk, build_step_inputs

GREEDY = SamplingParams(max_tokens=4, temperature=0)
SEEDED = SamplingParams(max_tokens=4, temperature=0.7, seed=11)


def _inputs():
    chunks = [ScheduledChunk([7, 8, 9], 0, [3]), ScheduledChunk([5], 6, [0, 4]), ScheduledChunk([2], 0, [1])]
    return build_step_inputs(chunks, block_size=4, num_tokens_padded=8)


def test_built_inputs_survive_the_hand_off_without_token_ids():
    built = _inputs()
    plan = MicroBatchPlan()
    tensors = pack_inputs(plan, built)
    # A middle stage passes exactly these tensors on; nothing else of the message is inputs.
    assert input_tensors({"plan": plan, "hidden": torch.zeros(1), **tensors}).keys() == tensors.keys()
    received = unpack_inputs(plan, {"plan": plan, **{k: v.clone() for k, v in tensors.items()}})
    assert received.input_ids.numel() == 0  # later stages start from hidden states
    assert torch.equal(received.positions, built.positions)
    assert received.num_scheduled_tokens == [3, 1, 1]
    for item in dataclasses.fields(AttentionMetadata):
        got, want = getattr(received.attn_metadata, item.name), getattr(built.attn_metadata, item.name)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, item.name


def test_an_empty_step_carries_no_inputs():
    assert pack_inputs(MicroBatchPlan(), None) == {}


def test_sampling_parameters_travel_once_per_request_and_again_after_a_drop():
    announcer, sampling = SamplingAnnouncer(), SamplingStates()
    first = MicroBatchPlan(request_ids=["a", "b"], new_sampling=announcer.new(["a", "b"], [GREEDY, SEEDED]))
    second = MicroBatchPlan(request_ids=["a", "b"], new_sampling=announcer.new(["a", "b"], [GREEDY, SEEDED]))
    assert list(first.new_sampling) == ["a", "b"] and second.new_sampling == {}
    for plan in (first, second):
        learn_sampling(sampling, plan)
    params, generators = sampling.for_requests(["b", "a"])
    assert params == [SEEDED, GREEDY] and len(generators) == 2

    # "a" finishes; a new request reuses its id in the very next micro-batch.
    announcer.forget(["a"])
    reused = SamplingParams(max_tokens=2, temperature=0.5, seed=3)
    third = MicroBatchPlan(request_ids=["a"], finished_ids=["a"], new_sampling=announcer.new(["a"], [reused]))
    assert third.new_sampling == {"a": reused}
    learn_sampling(sampling, third)  # drop first, then learn: the reused id keeps its new parameters
    assert sampling.for_requests(["a"])[0] == [reused]
    assert len(announcer) == len(sampling) == 2

    learn_sampling(sampling, MicroBatchPlan(finished_ids=["a", "b"]))
    assert len(sampling) == 0
    with pytest.raises(RuntimeError, match="no sampling state for request 'b'"):
        sampling.for_requests(["b"])


def test_the_last_stage_samples_as_the_first_stage_would_with_penalties_and_min_tokens():
    """The last stage's sampler for a request reads what one process's would: the prompt (the
    repetition penalty counts it) and the model's end tokens (`min_tokens` holds them off)."""
    from tandem.worker.sampling import sample_step

    eos, prompt = 3, [5, 6]
    penalized = SamplingParams(max_tokens=4, temperature=0, repetition_penalty=4.0)
    held = SamplingParams(max_tokens=4, temperature=0, min_tokens=2)
    # Row 0: a prompt token leads narrowly; row 1: the end token leads.
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 1.5, 0.0, 0.0],
                           [0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    one_process = [p.make_sampler(prompt, [eos]) for p in (penalized, held)]
    expected = sample_step(logits, [penalized, held], one_process).tokens.tolist()
    assert expected == [1, 1]

    announcer, sampling = SamplingAnnouncer(), SamplingStates(eos_token_ids=[eos])
    new_sampling = announcer.new(["p", "h"], [penalized, held])
    plan = MicroBatchPlan(request_ids=["p", "h"], new_sampling=new_sampling,
                          new_prompts=prompts_to_announce(new_sampling, ["p", "h"], [prompt, prompt]))
    assert list(plan.new_prompts) == ["p"]  # only a penalty that reads the prompt carries it
    learn_sampling(sampling, plan)
    params, samplers = sampling.for_requests(["p", "h"])
    assert sample_step(logits, params, samplers).tokens.tolist() == expected
