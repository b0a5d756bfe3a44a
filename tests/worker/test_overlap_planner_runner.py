"""The overlap planner and the cost-aware split inside ModelRunner: they change where and
whether a step is split, never its tokens."""

import dataclasses

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
from tandem.testing import run_distributed


def _overlap(**kw):
    return OverlapConfig(enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0, **kw)


def test_balanced_cost_split_moves_the_cut_and_keeps_the_logits(monkeypatch):
    import tandem.worker.model_runner as model_runner
    from tandem.worker.step_inputs import ScheduledChunk
    from tandem.engine.offline import build_runner
    from tandem.ubatch import split_by_tokens

    # A heavy attention price, so the cut moves well away from the token midpoint.
    monkeypatch.setattr(model_runner, "DEFAULT_ATTENTION_WEIGHT", 0.05)
    config = EngineConfig(model="tiny-moe", overlap=OverlapConfig(), cache=CacheConfig(num_kv_blocks=64, block_size=8))
    runner = build_runner(config)
    blocks = [runner.allocator.allocate(8) for _ in range(4)]
    # A 40-token prefill over a 20-token context first, then three decodes over short contexts.
    chunks = [ScheduledChunk(list(range(3, 43)), 20, blocks[0])] + [
        ScheduledChunk([50 + r], 2 + r, blocks[r + 1]) for r in range(3)
    ]
    hidden = {}
    for name, overlap in {
        "off": OverlapConfig(),
        "tokens": _overlap(),
        "balanced-cost": _overlap(ubatch_split="balanced-cost"),
    }.items():
        runner.overlap = overlap
        plan = runner.plan_step(chunks)
        inputs, slices = runner.step_inputs(chunks, plan), plan.ubatch_slices
        if name == "off":
            assert slices is None
        elif name == "tokens":
            assert list(slices) == split_by_tokens([40, 1, 1, 1], 2)
        else:
            # Most of the attention is in the prefill's late tokens: the first ubatch gets more tokens.
            assert slices[0].token_slice.stop > 22 and slices[0].request_slice == slice(0, 1)
        with torch.no_grad():
            hidden[name] = runner.forward(inputs.input_ids, inputs, plan)
    torch.testing.assert_close(hidden["tokens"], hidden["off"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden["balanced-cost"], hidden["off"], rtol=1e-4, atol=1e-4)


PROMPTS = {
    0: ["The quick brown fox jumps over the lazy dog, again and again.", "Hi", "MoE layers"],
    1: ["A", "Expert parallelism moves tokens to experts and back, twice"],
}


def _generate(rank, world, overlaps):
    import torch.distributed as dist

    from tandem.engine.offline import build_runner, generate
    from tandem.worker.sampling import SamplingParams

    out = []
    for overlap in overlaps:
        config = EngineConfig(
            model="tiny-moe", overlap=overlap, parallel=ParallelConfig(data_parallel_size=2),
            cache=CacheConfig(num_kv_blocks=64, block_size=4), max_num_batched_tokens=128,
        )
        runner = build_runner(config, group=dist.group.WORLD)
        tok = runner.info.tokenizer
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        done = generate(runner, [(i, tok.encode(p).ids, params) for i, p in enumerate(PROMPTS[rank])])
        stats = dataclasses.asdict(runner.planner.stats) if runner.planner is not None else None
        out.append(([c.token_ids for c in done], runner.ubatched_steps, stats))
    return out


@pytest.mark.slow
def test_auto_policy_and_balanced_cost_keep_greedy_tokens_and_ranks_agree():
    overlaps = [
        OverlapConfig(),
        _overlap(num_ubatches=3, overlap_policy="auto", ubatch_split="balanced-cost", planner_explore_share=0.05),
    ]
    per_rank = run_distributed(_generate, 2, overlaps, timeout_s=300)
    for (off_tokens, _, _), (auto_tokens, _, stats) in per_rank:
        assert auto_tokens == off_tokens
        assert sum(stats["choices"].values()) > 0 and set(stats["choices"]) == {"none", "dbo-2", "dbo-3"}
    # Every DP rank took the same choice at every step.
    assert per_rank[0][1][1] == per_rank[1][1][1]
    assert per_rank[0][1][2]["choices"] == per_rank[1][1][2]["choices"]
    assert per_rank[0][1][2]["explored_steps"] == per_rank[1][1][2]["explored_steps"]


def test_bad_policy_and_split_names_are_refused():
    with pytest.raises(ValueError, match="--overlap-policy"):
        OverlapConfig(overlap_policy="magic")
    with pytest.raises(ValueError, match="--ubatch-split"):
        OverlapConfig(ubatch_split="halves")
    with pytest.raises(ValueError, match="0.05"):
        OverlapConfig(planner_explore_share=0.2)
