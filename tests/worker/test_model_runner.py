"""ModelRunner on the built-in tiny-moe model across 2 gloo ranks: DBO must not change a
single greedy token, whatever the split."""

import pytest

from tandem.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig
from tandem.engine.offline import build_runner, generate
from tandem.worker.sampling import SamplingParams
from tandem.testing import run_distributed

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

PROMPTS = {
    # rank 0: one long prompt that straddles the ubatch cut, plus short ones
    0: ["The quick brown fox jumps over the lazy dog, again and again and again.", "Hi", "MoE"],
    # rank 1: different lengths, so the ranks' batches differ, and it finishes first, then
    # runs all-padding dummy batches (as ubatches too) while rank 0 decodes on
    1: ["A", "Expert parallelism moves tokens to experts and back, twice"],
}


def _config(enable_dbo, num_ubatches=2, all2all="torch_a2a", executor="thread", graph_mode="none"):
    return EngineConfig(
        model="tiny-moe",
        overlap=OverlapConfig(
            enable_dbo=enable_dbo,
            num_ubatches=num_ubatches,
            executor=executor,
            dbo_decode_token_threshold=0,
            dbo_prefill_token_threshold=0,
            graph_mode=graph_mode,
        ),
        parallel=ParallelConfig(data_parallel_size=2, all2all_backend=all2all),
        cache=CacheConfig(num_kv_blocks=64, block_size=4),
        max_num_batched_tokens=128,
    )


def _run(rank, world, configs, max_tokens_per_rank):
    import torch.distributed as dist

    outputs = []
    for config in configs:
        runner = build_runner(config, group=dist.group.WORLD)
        tok = runner.info.tokenizer
        prompts = PROMPTS[rank]
        params = [SamplingParams(max_tokens=max_tokens_per_rank[rank], temperature=0, ignore_eos=True)] * len(prompts)
        completions = generate(runner, [(i, tok.encode(p).ids, params[i]) for i, p in enumerate(prompts)])
        outputs.append(([c.token_ids for c in completions], runner.steps, runner.ubatched_steps))
    return outputs


@pytest.mark.parametrize(
    "num_ubatches, all2all, executor, graph_mode",
    [
        (2, "torch_a2a", "thread", "none"),
        (3, "torch_a2a_ll", "greenlet", "none"),
        (2, "torch_a2a_ll", "thread", "full"),
        (2, "torch_a2a", "stages", "none"),
        (2, "torch_a2a_ll", "stages", "full"),
    ],
)
def test_dbo_on_and_off_give_identical_greedy_tokens(num_ubatches, all2all, executor, graph_mode):
    configs = [
        _config(False, all2all=all2all),
        _config(True, num_ubatches, all2all=all2all, executor=executor, graph_mode=graph_mode),
    ]
    # Rank 1 stops after 3 tokens and then runs dummy batches while rank 0 decodes on.
    per_rank = run_distributed(_run, 2, configs, {0: 6, 1: 3}, timeout_s=300)
    for rank, ((off_tokens, off_steps, off_ubatched), (on_tokens, on_steps, on_ubatched)) in enumerate(per_rank):
        assert on_tokens == off_tokens, f"rank {rank}"
        assert [len(t) for t in on_tokens] == [6] * 3 if rank == 0 else [3] * 2
        assert off_ubatched == 0
        assert on_ubatched > 0 and on_steps == off_steps


def _runner_on_a_subgroup(rank, world):
    import torch.distributed as dist

    alone = dist.new_group([0], backend="gloo")  # collective: every rank creates it
    if rank != 0:
        return None
    config = EngineConfig(model="tiny-moe", overlap=OverlapConfig(enable_dbo=True), cache=CacheConfig(num_kv_blocks=16))
    runner = build_runner(config, group=alone)
    tok = runner.info.tokenizer
    completions = generate(runner, [(0, tok.encode("Hi").ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))])
    return runner.dp_group is alone, len(completions[0].token_ids)


def test_a_runner_on_a_gloo_subgroup_decides_its_steps_on_that_group():
    """A runner whose group is a gloo group of some ranks (pp1 beside a pipeline in the PP
    benchmark) agrees on its steps within that group; the world's CPU group would wait for
    ranks that never step."""
    assert run_distributed(_runner_on_a_subgroup, 2, timeout_s=120) == [(True, 2), None]
