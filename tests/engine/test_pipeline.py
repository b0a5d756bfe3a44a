"""Pipeline parallelism on real gloo ranks: two stages give the greedy tokens of one process
for every model family, with async depth 0, 1 and 2 (more micro-batches than stages in
flight: the send buffers must live until the receiver has them, sglang#15527), through
chunked prefill (prompts longer than the step budget)."""

from __future__ import annotations

import pytest

from tandem.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tandem.models.loader import load_model
from tandem.engine.core import Engine
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams
from tandem.testing.distributed import run_distributed
from tests.support.hf_checkpoints import FAMILIES, build_hf_model, save_checkpoint

#: Real processes (servers, ranks, the command line): not in the fast tier, `-m "not slow"`.
pytestmark = pytest.mark.slow

PROMPTS = ["Pipeline stages pass hidden states along.", "Hi", "Experts route tokens", "A"]
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
BUDGET = 12  # tokens per step: the long prompts take several chunks


def _config(model: str, **parallel) -> EngineConfig:
    return EngineConfig(
        model=model, parallel=ParallelConfig(**parallel), cache=CacheConfig(num_kv_blocks=96, block_size=4),
        max_num_batched_tokens=BUDGET,
    )


def one_process_tokens(model: str, prompts: list[str] = PROMPTS) -> list[list[int]]:
    info = load_model(model)
    engine = Engine(ModelRunner(info, num_kv_blocks=96, block_size=4), SchedulerConfig(overlap_schedule=False), max_num_batched_tokens=BUDGET)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), info.tokenizer.encode(prompt).ids, PARAMS)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def _pipeline_rank(rank, world, cases):
    from tandem.engine.offline import generate_on_rank

    results = []
    for model, parallel in cases:
        completions = generate_on_rank(rank, world, _config(model, **parallel), PROMPTS, PARAMS)
        results.append([c.token_ids for c in sorted(completions, key=lambda c: c.index)])
    return results


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    return ["tiny-moe"] + [str(save_checkpoint(build_hf_model(f), tmp_path_factory.mktemp(f))) for f in FAMILIES]


def test_two_stages_give_one_process_greedy_tokens_for_every_family(family_models):
    cases = [(m, {"pipeline_parallel_size": 2}) for m in family_models]
    cases += [("tiny-moe", {"pipeline_parallel_size": 2, "pp_async_batch_depth": depth}) for depth in (1, 2)]
    first_stage, last_stage = run_distributed(_pipeline_rank, 2, cases, timeout_s=120)
    assert all(result == [] for result in last_stage)
    expected = {m: one_process_tokens(m) for m in family_models}
    for (model, parallel), got in zip(cases, first_stage):
        assert got == expected[model], (model, parallel)


DBO_PROMPTS = [f"micro-batch {i} flows through the stages" for i in range(8)]


def test_two_stages_by_two_dp_ranks_with_dbo_give_one_process_greedy_tokens(family_models):
    """World = PP 2 x DP 2 (4 processes), the MoE layers expert-parallel over each stage's
    two ranks, DBO on (thresholds 2): the tokens of one process, and both stages did split
    steps into ubatches."""
    dbo = {"enable_dbo": True, "dbo_decode_token_threshold": 2, "dbo_prefill_token_threshold": 2}
    parallel = {"pipeline_parallel_size": 2, "data_parallel_size": 2, "all2all_backend": "torch_a2a", "pp_async_batch_depth": 1}
    models = family_models  # tiny-moe (DeepSeek, MLA) and every HF family
    results = run_distributed(_pipeline_rank_dbo, 4, [(m, parallel) for m in models], dbo, timeout_s=300)
    for index, model in enumerate(models):
        got = {}
        for tokens, _ in results[:2]:  # the first stage's two DP ranks
            got.update(tokens[index])
        assert [got[i] for i in range(len(DBO_PROMPTS))] == one_process_tokens(model, DBO_PROMPTS), model
    assert all(r == {} for tokens, _ in results[2:] for r in tokens)
    assert all(ubatched > 0 for _, counts in results for ubatched in counts), [c for _, c in results]


def _pipeline_rank_dbo(rank, world, cases, dbo):
    from tandem.config import OverlapConfig
    from tandem.engine.offline import generate_on_rank

    tokens, ubatched = [], []
    for model, parallel in cases:
        config = _config(model, **parallel)
        config.overlap = OverlapConfig(**dbo)
        completions = generate_on_rank(
            rank, world, config, DBO_PROMPTS, PARAMS, on_finish=lambda runner: ubatched.append(runner.ubatched_steps)
        )
        tokens.append({c.index: c.token_ids for c in completions})
    return tokens, ubatched
