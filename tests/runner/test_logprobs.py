"""Log-probabilities through the engine (scheduler, overlapped loop, one host read per step)
equal transformers' log-softmax of the same checkpoint, in fp32."""

from __future__ import annotations

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig
from tandem.runner.engine import Engine
from tandem.runner.offline import build_runner
from tandem.runner.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

from tests.models.hf_checkpoints import build_hf_model, hf_logits, save_checkpoint  # noqa: E402

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
TOP = 3


@pytest.mark.parametrize("overlap_schedule", [True, False], ids=["overlap", "normal"])
def test_greedy_logprobs_equal_transformers_log_softmax(tmp_path, overlap_schedule):
    hf = build_hf_model("qwen3_moe")
    model_dir = save_checkpoint(hf, tmp_path / "qwen3_moe")
    config = EngineConfig(model=str(model_dir), cache=CacheConfig(num_kv_blocks=32, block_size=4),
                          max_num_batched_tokens=64)
    engine = Engine(build_runner(config), overlap_schedule=overlap_schedule)
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
