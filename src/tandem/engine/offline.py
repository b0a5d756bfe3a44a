"""Offline generation (`tandem generate`): the prompts go through the same `Engine` loop
as serving — scheduler, stop checks, detokenizer — on every rank. With several DP ranks each
runs its own prompts in lockstep (idle ranks join with dummy batches) until a step finds
every rank done; with pipeline parallelism the first stage's `PipelineEngine` runs them."""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.engine.build import build_engine
from tandem.engine.core import run_to_completion
from tandem.engine.outputs import Completion
from tandem.worker.build import build_runner, write_rank_trace
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampling import SamplingParams


def generate(
    runner: ModelRunner,
    prompts: list[tuple[int, list[int], SamplingParams]],
    *,
    config: EngineConfig | None = None,
) -> list[Completion]:
    """`prompts` are `(index, prompt_token_ids, params)`; returns completions in input order.
    The engine's settings are `config`'s (default: the ones the runner was built from)."""
    config = config or runner.config or EngineConfig()
    return run_to_completion(build_engine(config, runner=runner), prompts)


def generate_on_rank(
    rank: int, world_size: int, config, prompts: list[str], params: SamplingParams, *, on_finish=None
) -> list[Completion]:
    """One rank of `tandem generate`: prompt i runs on DP rank i % D (with pipeline
    parallelism: on the first stage's DP column i % D; the later stages return an empty
    list). `on_finish(runner)` is called at the end (its counters: steps, ubatched steps)."""
    engine = build_engine(config)
    if not engine.takes_requests:
        engine.run()
        completions = []
    else:
        tokenizer = engine.runner.info.tokenizer
        mine = [(i, tokenizer.encode(p).ids, params) for i, p in engine.my_prompts(prompts, rank, world_size)]
        completions = run_to_completion(engine, mine)
    write_rank_trace(engine.runner, config.trace_path, group=engine.trace_group(None))
    if on_finish is not None:
        on_finish(engine.runner)
    return completions


__all__ = ["Completion", "build_runner", "generate", "generate_on_rank", "write_rank_trace"]
