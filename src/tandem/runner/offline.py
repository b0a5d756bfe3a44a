"""Offline generation on one rank: every prompt prefilled, then decoded step by step until
each stops. With several DP ranks each runs its own prompts, and steps continue (with
dummy batches on idle ranks) until every rank is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tandem.runner.batch import ScheduledChunk
from tandem.runner.build import build_runner, write_rank_trace
from tandem.runner.kv_cache import blocks_needed
from tandem.runner.model_runner import ModelRunner
from tandem.runner.outputs import Completion
from tandem.runner.sampling import SamplingParams


@dataclass
class _Sequence:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    text: str = ""
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def _check_stop(seq: _Sequence, token: int, eos_ids: set[int], decode: Callable[[list[int]], str]) -> None:
    seq.output_ids.append(token)
    p = seq.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        seq.output_ids.pop()  # stop tokens are not part of the completion
        seq.finish_reason = "stop"
    seq.text = decode(seq.output_ids)
    for stop in p.stop:
        at = seq.text.find(stop)
        if at >= 0:
            seq.text = seq.text[:at]
            seq.finish_reason = "stop"
    if seq.finish_reason is None and len(seq.output_ids) >= p.max_tokens:
        seq.finish_reason = "length"


def generate(
    runner: ModelRunner,
    prompts: list[tuple[int, list[int], SamplingParams]],
    *,
    on_token: Callable[[int], None] | None = None,
) -> list[Completion]:
    """`prompts` are `(index, prompt_token_ids, params)`; returns completions in input order."""
    info = runner.info
    decode = lambda ids: info.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    max_len = info.max_model_len
    sequences = []
    for index, ids, params in prompts:
        if not ids:
            raise ValueError(f"prompt {index} is empty after tokenization")
        if len(ids) + params.max_tokens > max_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with max_tokens={params.max_tokens} it exceeds the "
                f"model's context length {max_len}"
            )
        sequences.append(_Sequence(index, list(ids), params))
    generators = {s.index: s.params.make_sampler(runner.device, s.tokens, sorted(info.eos_token_ids)) for s in sequences}
    while True:
        active = [s for s in sequences if s.finish_reason is None]
        chunks = []
        for s in active:
            need = blocks_needed(len(s.tokens), runner.block_size) - len(s.blocks)
            if need > 0:
                s.blocks += runner.allocator.allocate(need)
            chunks.append(ScheduledChunk(s.tokens[s.computed :], s.computed, s.blocks))
        result = runner.execute(chunks, [s.params for s in active], [generators[s.index] for s in active])
        if result.num_tokens_padded == 0:
            break  # every rank is done
        for s, token in zip(active, result.tokens):
            s.computed = len(s.tokens)
            _check_stop(s, token, info.eos_token_ids, decode)
            if on_token is not None:
                on_token(1)
            if s.finish_reason is not None:
                runner.allocator.free(s.blocks)
                s.blocks = []
    return [Completion(s.index, s.text, s.output_ids, s.finish_reason) for s in sequences]


def generate_on_rank(rank: int, world_size: int, config, prompts: list[str], params: SamplingParams) -> list[Completion]:
    """One DP rank of `tandem generate`: prompt i runs on rank i % world_size (with pipeline
    parallelism: on the i % D-th rank of the first stage)."""
    import torch.distributed as dist

    if config.parallel.pipeline_parallel_size > 1:
        from tandem.runner.pipeline import generate_pipeline_rank

        return generate_pipeline_rank(rank, world_size, config, prompts, params)

    runner = build_runner(config, group=dist.group.WORLD if world_size > 1 else None)
    tokenizer = runner.info.tokenizer
    mine = [(i, tokenizer.encode(p).ids, params) for i, p in enumerate(prompts) if i % world_size == rank]
    completions = generate(runner, mine)
    write_rank_trace(runner, config.trace_path)
    return completions


__all__ = ["Completion", "build_runner", "generate", "generate_on_rank", "write_rank_trace"]
