"""Runs of the one-rank tiny-moe `Engine` over a fixed set of prompts, shared by the engine
tests (the loops must agree token for token; logprobs must survive preemption)."""

from __future__ import annotations

from tandem.config import OverlapConfig, SchedulerConfig
from tandem.engine.core import Engine
from tandem.models.tiny_moe import build_tiny_moe
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams

PROMPTS = [
    "Dual batch overlap hides the all-to-all behind compute.",
    "Hi",
    "Experts",
    "A rather long prompt that will certainly need several prefill chunks to get through.",
    "MoE",
    "Tokens go to experts and come back.",
]


def tiny_moe_engine(overlap: bool, *, num_kv_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32):
    info = build_tiny_moe()
    runner = ModelRunner(info, overlap=OverlapConfig(), num_kv_blocks=num_kv_blocks, block_size=block_size)
    return Engine(runner, SchedulerConfig(max_num_seqs=max_num_seqs, overlap_schedule=overlap), max_num_batched_tokens=max_num_batched_tokens)


def run_prompts(engine: Engine, params_for, *, max_steps=2000) -> dict[str, list]:
    tokenizer = engine.runner.info.tokenizer
    for i, prompt in enumerate(PROMPTS):
        assert engine.add_request(f"r{i}", tokenizer.encode(prompt).ids, params_for(i)) is None
    outputs: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for _ in range(max_steps):
        for out in engine.step():
            outputs[out.request_id].append(out)
        if not engine.has_work:
            break
    else:
        raise AssertionError("engine did not finish")
    engine.close()
    return outputs


def tokens_by_request(outputs):
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def mixed_params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=7 + i, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True)
