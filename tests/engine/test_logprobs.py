"""Log-probabilities through the engine (scheduler, overlapped loop, one host read per step)
equal transformers' log-softmax of the same checkpoint, in fp32."""

from __future__ import annotations

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.core import Engine
from tandem.engine.offline import build_runner
from tandem.worker.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

from tests.support.hf_checkpoints import build_hf_model, hf_logits, save_checkpoint  # noqa: E402

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
TOP = 3


@pytest.mark.parametrize("overlap_schedule", [True, False], ids=["overlap", "normal"])
def test_greedy_logprobs_equal_transformers_log_softmax(tmp_path, overlap_schedule):
    hf = build_hf_model("qwen3_moe")
    model_dir = save_checkpoint(hf, tmp_path / "qwen3_moe")
    config = EngineConfig(model=str(model_dir), cache=CacheConfig(num_kv_blocks=32, block_size=4),
                          max_num_batched_tokens=64)
    engine = Engine(build_runner(config), SchedulerConfig(overlap_schedule=overlap_schedule))
    try:
        engine.add_request("lp", PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=TOP))
        # A second request without logprobs in the same steps: its rows are skipped.
        engine.add_request("plain", PROMPT[:4], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        tokens, logprobs = [], []
        for _ in range(50):
            for out in engine.step() + (engine.drain() if not engine.has_work else []):
                if out.request_id == "lp":
                    tokens += out.new_token_ids
                    logprobs += out.new_logprobs
                else:
                    assert out.new_logprobs is None
            if not engine.has_work:
                break
    finally:
        engine.close()
    assert len(tokens) == 5 and len(logprobs) == 5
    expected = hf_logits(hf, PROMPT + tokens[:-1]).float().log_softmax(-1)[len(PROMPT) - 1 :]
    for k, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert len(entry) == 1 + TOP
        (sampled, sampled_lp), top = entry[0], entry[1:]
        assert sampled == token == int(expected[k].argmax())
        assert abs(sampled_lp - float(expected[k, token])) < 1e-4
        want = expected[k].topk(TOP)
        assert [t for t, _ in top] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), want.values, atol=1e-4, rtol=0)


def _run_prompt_logprobs(model_dir, requests, *, max_num_batched_tokens: int, overlap_schedule: bool = True):
    """Run `requests` ({id: (prompt, SamplingParams)}) to the end; return each one's prompt
    log-probabilities (from its first output) and how many outputs carried any."""
    config = EngineConfig(model=str(model_dir), cache=CacheConfig(num_kv_blocks=32, block_size=4),
                          max_num_batched_tokens=max_num_batched_tokens)
    engine = Engine(build_runner(config), SchedulerConfig(overlap_schedule=overlap_schedule))
    prompt_logprobs, carried = {}, {rid: 0 for rid in requests}
    try:
        for rid, (prompt, params) in requests.items():
            assert engine.add_request(rid, prompt, params) is None
        while engine.has_work:
            for out in engine.step() + (engine.drain() if not engine.has_work else []):
                if out.prompt_logprobs is not None:
                    carried[out.request_id] += 1
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
    finally:
        engine.close()
    return prompt_logprobs, carried


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    hf = build_hf_model("qwen3_moe")
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("ckpt") / "qwen3_moe")


def _assert_prompt_logprobs_match(entries, expected, prompt, top):
    """`entries[k]` is prompt token k + 1's: itself first, then the `top` most likely."""
    assert len(entries) == len(prompt) - 1
    for k, entry in enumerate(entries):
        assert len(entry) == 1 + top
        (token, logprob), alternatives = entry[0], entry[1:]
        assert token == prompt[k + 1]
        assert abs(logprob - float(expected[k, token])) < 1e-4
        want = expected[k].topk(top)
        assert [t for t, _ in alternatives] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in alternatives]), want.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overlap_schedule", [True, False], ids=["overlap", "normal"])
def test_prompt_logprobs_equal_transformers_log_softmax(qwen3_moe, overlap_schedule):
    """vLLM's `prompt_logprobs`: each prompt token after the first, given the ones before it,
    with the top-N at its place; batched with a request that asks for none and one that asks
    for a different N, all in one step."""
    hf, model_dir = qwen3_moe
    other = [5, 17, 200, 42, 9, 81]
    got, carried = _run_prompt_logprobs(model_dir, {
        "top3": (PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=TOP)),
        "plain": (PROMPT[:4], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
        "top0": (other, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)),
    }, max_num_batched_tokens=64, overlap_schedule=overlap_schedule)
    assert carried == {"top3": 1, "plain": 0, "top0": 1}  # once, on the first output
    _assert_prompt_logprobs_match(got["top3"], hf_logits(hf, PROMPT).log_softmax(-1), PROMPT, TOP)
    _assert_prompt_logprobs_match(got["top0"], hf_logits(hf, other).log_softmax(-1), other, 0)


def test_chunked_prefill_gives_the_one_shot_prompt_logprobs(qwen3_moe):
    """A prompt prefilled over several steps (3 tokens a step, two requests sharing the
    budget) collects its rows chunk by chunk: the same values as in one step."""
    _, model_dir = qwen3_moe
    second = list(reversed(PROMPT))
    requests = {
        "a": (PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)),
        "b": (second, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)),
    }
    one_shot, _ = _run_prompt_logprobs(model_dir, requests, max_num_batched_tokens=64)
    chunked, _ = _run_prompt_logprobs(model_dir, requests, max_num_batched_tokens=3)
    for rid, prompt in (("a", PROMPT), ("b", second)):
        assert [[t for t, _ in e] for e in chunked[rid]] == [[t for t, _ in e] for e in one_shot[rid]]
        torch.testing.assert_close(torch.tensor([[lp for _, lp in e] for e in chunked[rid]]),
                                   torch.tensor([[lp for _, lp in e] for e in one_shot[rid]]), atol=1e-5, rtol=0)
        assert [e[0][0] for e in chunked[rid]] == prompt[1:]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_prompt_logprobs_survive_preemption(overlap):
    """A cache so small that requests are preempted (their prompts recomputed): each prompt's
    log-probabilities still come once, one per prompt token after the first, equal to a run
    that never preempts. (tiny-moe, chunked prefill of 32 tokens a step.)"""
    from tests.support.engine_runs import PROMPTS, mixed_params, run_prompts, tiny_moe_engine

    def params(i: int) -> SamplingParams:
        p = mixed_params(i)
        p.prompt_logprobs = 1
        return p

    tight_engine = tiny_moe_engine(overlap, num_kv_blocks=40)
    tight = run_prompts(tight_engine, params)
    assert tight_engine.scheduler.num_preemptions > 0
    roomy = run_prompts(tiny_moe_engine(overlap, num_kv_blocks=256), params)
    tokenizer = tight_engine.runner.info.tokenizer
    for i, rid in enumerate(tight):
        prompt = tokenizer.encode(PROMPTS[i]).ids
        carried = [o.prompt_logprobs for o in tight[rid] if o.prompt_logprobs is not None]
        assert len(carried) == 1 and [e[0][0] for e in carried[0]] == prompt[1:]
        (expected,) = [o.prompt_logprobs for o in roomy[rid] if o.prompt_logprobs is not None]
        torch.testing.assert_close(torch.tensor([[lp for _, lp in e] for e in carried[0]]),
                                   torch.tensor([[lp for _, lp in e] for e in expected]), atol=1e-5, rtol=0)
