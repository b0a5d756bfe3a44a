"""The micro-batch ring of a two-stage pipeline on real gloo ranks: between steps it stays full
(M micro-batches in flight, M = 1 too, so the later stage works while the first stage's caller
hands outputs on), and greedy and seeded tokens equal one process's whatever M is, penalties
and min_tokens included."""

from __future__ import annotations

from tandem.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tandem.engine.core import Engine
from tandem.models.loader import load_model
from tandem.testing.distributed import run_distributed
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams

PROMPTS = ["ring one", "ring two", "three", "four", "five", "six"]
PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)] * 2 + [
    # The last stage samples: it must see the prompt the repetition penalty counts and the
    # model's end tokens that min_tokens holds off, as one process's scheduler does.
    SamplingParams(max_tokens=6, temperature=0, repetition_penalty=3.0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, seed=5, min_tokens=6),
]
RINGS = (1, 2, 3)


def _config() -> EngineConfig:
    return EngineConfig(model="tiny-moe", parallel=ParallelConfig(pipeline_parallel_size=2),
                        cache=CacheConfig(num_kv_blocks=64, block_size=4), max_num_batched_tokens=64)


def _run(engine, tokenizer) -> tuple[list[list[int]], list[tuple[int, bool]]]:
    """Tokens per prompt, and after each step (micro-batches in flight, whether a request had finished)."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(i), tokenizer.encode(prompt).ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    depths, finished = [], False
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            finished |= out.finished
        depths.append((getattr(engine, "micro_batches_in_flight", 0), finished))
    return [tokens[str(i)] for i in range(len(PROMPTS))], depths


def _ring_rank(rank, world):
    from tandem.engine.build import build_pipeline_stage
    from tandem.engine.pipeline import PipelineEngine, run_stage

    runner, groups = build_pipeline_stage(_config())
    if groups.stage != 0:
        for _ in RINGS:
            run_stage(runner, groups, num_micro_batches=max(RINGS))
        return None
    results = {}
    for ring in RINGS:
        engine = PipelineEngine(runner, groups, num_micro_batches=ring, max_num_batched_tokens=64)
        results[ring] = _run(engine, runner.info.tokenizer)
        engine.close()
    return results


def test_the_ring_stays_full_between_steps_and_tokens_equal_one_process():
    first_stage, last_stage = run_distributed(_ring_rank, 2, timeout_s=180)
    assert last_stage is None
    info = load_model("tiny-moe")
    expected, _ = _run(Engine(ModelRunner(info, num_kv_blocks=64, block_size=4), SchedulerConfig(overlap_schedule=False),
                              max_num_batched_tokens=64), info.tokenizer)
    for ring, (tokens, depths) in first_stage.items():
        assert tokens == expected, ring
        # Each micro-batch takes 6 / ring requests: the ring fills after `ring` steps
        # and stays full until requests start finishing.
        before_finish = [depth for depth, finished in depths if not finished]
        assert before_finish[ring - 1:] and all(d == ring for d in before_finish[ring - 1:]), (ring, depths)
        assert depths[-1][0] == 0, ring
