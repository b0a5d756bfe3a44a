"""Engine on one rank with the built-in tiny-moe: the overlapped loop gives exactly the
normal loop's tokens, through chunked prefill, preemption and aborts."""

from __future__ import annotations

import pytest

from tandem.worker.sampling import SamplingParams
from tests.support.engine_runs import PROMPTS, mixed_params, run_prompts, tiny_moe_engine, tokens_by_request


@pytest.mark.parametrize("num_kv_blocks", [256, 40], ids=["roomy", "preempting"])
def test_overlap_and_normal_loops_give_identical_tokens(num_kv_blocks):
    normal_engine = tiny_moe_engine(False, num_kv_blocks=num_kv_blocks)
    normal = run_prompts(normal_engine, mixed_params)
    overlap_engine = tiny_moe_engine(True, num_kv_blocks=num_kv_blocks)
    overlapped = run_prompts(overlap_engine, mixed_params)
    assert tokens_by_request(overlapped) == tokens_by_request(normal)
    for i, rid in enumerate(normal):
        assert len(tokens_by_request(normal)[rid]) == mixed_params(i).max_tokens
        assert normal[rid][-1].finished and normal[rid][-1].finish_reason == "length"
    # Everything freed at the end; the small cache really did preempt.
    for engine in (normal_engine, overlap_engine):
        assert engine.runner.allocator.num_free == engine.runner.allocator.num_blocks
    if num_kv_blocks == 40:
        assert normal_engine.scheduler.num_preemptions > 0 and overlap_engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_independent_of_the_batch():
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    together = run_prompts(tiny_moe_engine(True), lambda i: params)
    alone_engine = tiny_moe_engine(True)
    tokenizer = alone_engine.runner.info.tokenizer
    alone_engine.add_request("solo", tokenizer.encode(PROMPTS[3]).ids, params)
    solo = []
    while alone_engine.has_work:
        solo += [t for o in alone_engine.step() for t in o.new_token_ids]
    assert solo == tokens_by_request(together)["r3"]


def test_stop_strings_truncate_and_never_leak_in_deltas():
    engine = tiny_moe_engine(True)
    tokenizer = engine.runner.info.tokenizer
    ids = tokenizer.encode("Hi").ids
    probe = engine.add_request("probe", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert probe is None
    text = ""
    while engine.has_work:
        text += "".join(o.new_text for o in engine.step())
    stop = text[4:6]
    engine.add_request("stopped", ids, SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True))
    deltas = []
    while engine.has_work:
        deltas += engine.step()
    assert "".join(d.new_text for d in deltas) == text[: text.find(stop)]
    assert deltas[-1].finish_reason == "stop"
    engine.close()


def test_abort_frees_blocks_at_once_and_others_continue():
    engine = tiny_moe_engine(True)
    tokenizer = engine.runner.info.tokenizer
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("keep", tokenizer.encode(PROMPTS[0]).ids, params)
    engine.add_request("drop", tokenizer.encode(PROMPTS[3]).ids, params)
    for _ in range(6):
        engine.step()
    free_before = engine.runner.allocator.num_free
    aborted = engine.abort("drop")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert engine.runner.allocator.num_free > free_before
    assert engine.abort("drop") is None  # already gone
    kept = []
    while engine.has_work:
        kept += [o for o in engine.step()]
    assert {o.request_id for o in kept} == {"keep"}
    assert kept[-1].num_output_tokens == 40
    assert engine.runner.allocator.num_free == engine.runner.allocator.num_blocks
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlapped"])
def test_no_request_leaves_state_behind_however_it_ends(overlap):
    """Distinct per-request inputs (stop strings, logit-bias maps, seeds, penalties), ended by
    finishing, a stop string, an abort mid-decode and preemption: afterwards the engine holds
    no entry for any of them (scheduler, output states, samplers, KV blocks)."""
    engine = tiny_moe_engine(overlap, num_kv_blocks=40)
    tokenizer = engine.runner.info.tokenizer
    for i, prompt in enumerate(PROMPTS * 3):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=i, stop=[f"stop-{i}"], logit_bias={i + 5: 2.0},
                                repetition_penalty=1.0 + i / 100, ignore_eos=True)
        assert engine.add_request(f"r{i}", tokenizer.encode(prompt).ids, params) is None
    for _ in range(8):
        engine.step()
    engine.abort("r1")
    engine.abort("r4")
    while engine.has_work:
        engine.step()
    engine.step()  # an idle step after the last: nothing left to apply
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.requests == {} and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.outputs.states == {}
    assert len(engine.sampling) == 0 and engine.sampling.samplers == {}
    assert engine.runner.allocator.num_free == engine.runner.allocator.num_blocks
    engine.close()


def test_requests_that_cannot_fit_are_rejected_with_a_reason():
    engine = tiny_moe_engine(False, num_kv_blocks=8)
    too_long = engine.add_request("big", list(range(40)), SamplingParams(max_tokens=10))
    assert too_long.finish_reason == "error" and "KV cache" in too_long.error
    over_context = engine.add_request("ctx", [1] * 2040, SamplingParams(max_tokens=16))
    assert over_context.finish_reason == "error" and "context length 2048" in over_context.error
    engine.close()


def test_a_prompt_token_outside_the_vocabulary_is_refused_and_the_others_run_on():
    engine = tiny_moe_engine(False)
    vocab = engine.scheduler.vocab_size
    assert vocab is not None
    refused = engine.add_request("bad", [5, vocab, 7], SamplingParams(max_tokens=2))
    assert refused.finish_reason == "error" and f"token id {vocab}" in refused.error
    assert engine.add_request("negative", [-3], SamplingParams(max_tokens=2)).finish_reason == "error"
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["good"] and outputs[-1].finish_reason == "length"
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_request_event_times_for_the_metrics(overlap):
    """The scheduler times each request's events on its rank's clock: queued, first scheduled
    (kept through preemption), and one time per sampled token, in order."""
    engine = tiny_moe_engine(overlap, num_kv_blocks=40)
    outputs = run_prompts(engine, mixed_params)
    assert engine.scheduler.num_preemptions > 0
    for i, outs in enumerate(outputs.values()):
        assert len({o.queued_at for o in outs}) == 1 and len({o.scheduled_at for o in outs}) == 1
        times = [t for o in outs for t in o.token_times]
        assert len(times) == mixed_params(i).max_tokens  # ignore_eos: every sampled token is delivered
        assert outs[0].queued_at <= outs[0].scheduled_at <= times[0]
        assert times == sorted(times)


def test_a_stop_token_is_timed_though_not_delivered():
    engine = tiny_moe_engine(True)
    ids = engine.runner.info.tokenizer.encode("Hi").ids
    engine.add_request("probe", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    probe = []
    while engine.has_work:
        probe += [t for o in engine.step() for t in o.new_token_ids]
    stop_at = next(k for k in range(1, len(probe)) if probe[k] not in probe[:k])
    engine.add_request("stopped", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                       stop_token_ids=[probe[stop_at]]))
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == stop_at
    assert len([t for o in outs for t in o.token_times]) == stop_at + 1
    engine.close()
