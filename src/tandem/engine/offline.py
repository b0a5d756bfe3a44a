"""Offline generation (`tandem generate`): the prompts go through the same `Engine` loop
as serving — scheduler, stop checks, detokenizer — on every rank. With several DP ranks each
runs its own prompts in lockstep (idle ranks join with dummy batches) until a step finds
every rank done; with pipeline parallelism the first stage's `PipelineEngine` runs them."""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.worker.build import build_runner, write_rank_trace
from tandem.engine.core import Engine, run_to_completion
from tandem.worker.model_runner import ModelRunner
from tandem.engine.outputs import Completion
from tandem.worker.sampling import SamplingParams


def generate(
    runner: ModelRunner,
    prompts: list[tuple[int, list[int], SamplingParams]],
    *,
    config: EngineConfig | None = None,
) -> list[Completion]:
    """`prompts` are `(index, prompt_token_ids, params)`; returns completions in input order.
    The engine's settings are `config`'s (default: the ones the runner was built from)."""
    import torch.distributed as dist

    config = config or runner.config or EngineConfig()
    group = runner.dp_group
    lockstep = group is not None and dist.get_world_size(group) > 1
    return run_to_completion(Engine.from_config(runner, config, lockstep=lockstep), prompts)


def generate_on_rank(rank: int, world_size: int, config, prompts: list[str], params: SamplingParams) -> list[Completion]:
    """One DP rank of `tandem generate`: prompt i runs on rank i % world_size (with pipeline
    parallelism: on the i % D-th rank of the first stage)."""
    import torch.distributed as dist

    if config.parallel.pipeline_parallel_size > 1:
        from tandem.engine.pipeline import generate_pipeline_rank

        return generate_pipeline_rank(rank, world_size, config, prompts, params)

    runner = build_runner(config, group=dist.group.WORLD if world_size > 1 else None)
    tokenizer = runner.info.tokenizer
    mine = [(i, tokenizer.encode(p).ids, params) for i, p in enumerate(prompts) if i % world_size == rank]
    completions = generate(runner, mine, config=config)
    write_rank_trace(runner, config.trace_path)
    return completions


__all__ = ["Completion", "build_runner", "generate", "generate_on_rank", "write_rank_trace"]
