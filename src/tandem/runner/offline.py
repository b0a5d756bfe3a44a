"""Offline generation on one rank: every prompt prefilled, then decoded step by step until
each stops. With several DP ranks each runs its own prompts, and steps continue (with
dummy batches on idle ranks) until every rank is done."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tandem.runner.batch import ScheduledChunk
from tandem.runner.kv_cache import blocks_needed
from tandem.runner.model_runner import ModelRunner
from tandem.runner.sampling import SamplingParams


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"


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


def build_runner(config, *, group=None, cpu_group=None, stage=None) -> ModelRunner:
    """Load `config.model` for this rank (its experts only; with `stage`, a
    `tandem.distributed.StageLayers`, only that pipeline stage's layers) on the rank's device
    and wrap it in a ModelRunner. `group` carries the model's tensor collectives (the device
    group); `cpu_group` the step decisions over the same ranks (default: `group` itself when it
    is a gloo group, `launch.cpu_group()` when `group` is the whole world)."""
    import torch.distributed as dist

    from tandem.models.base import MoEOptions
    from tandem.models.loader import load_model
    from tandem.modular_kernels import FabricModel
    from tandem.runner.launch import cpu_group as default_cpu_group, local_rank

    if group is not None and cpu_group is None:
        if dist.get_backend(group) == "gloo":
            cpu_group = group
        elif dist.get_world_size(group) == dist.get_world_size():
            cpu_group = default_cpu_group()
        else:
            # The world's CPU group would wait for ranks that never join this group's steps.
            raise ValueError("build_runner: a device group smaller than the world needs its own gloo cpu_group")
    device = config.resolve_device(local_rank(dist.get_rank() if dist.is_initialized() else 0))
    par = config.parallel
    moe = MoEOptions(
        all2all_backend=par.all2all_backend,
        moe_backend=par.moe_backend,
        group=group,
        max_tokens_per_rank=config.max_num_batched_tokens,
        use_fp8_dispatch=par.use_fp8_dispatch,
        enable_sbo=par.enable_sbo,
        sbo_mode=par.sbo_mode,
        fabric=FabricModel.from_flags(par.fabric_latency_us, par.fabric_gbps, par.fabric),
        deepep_ll_max_tokens_per_rank=par.deepep_ll_max_tokens_per_rank,
        comm_sms=config.overlap.comm_sms,
    )
    info = load_model(config.model, moe=moe, dtype=config.resolve_dtype(device), device=device, stage=stage)
    tracer = None
    if config.trace_path is not None:
        from tandem.contexts.trace import Tracer

        tracer = Tracer(dist.get_rank(group) if group is not None else 0)
    return ModelRunner(
        info,
        overlap=config.overlap,
        num_kv_blocks=config.cache.num_kv_blocks,
        block_size=config.cache.block_size,
        dp_group=cpu_group,
        tracer=tracer,
    )


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


def write_rank_trace(runner: ModelRunner, path: str | None, group=None) -> None:
    """`--trace`: every rank hands its timeline to rank 0 of `group`, which writes `path`."""
    if runner.tracer is None or path is None:
        return
    from tandem.contexts.trace import gather_trace, write_trace
    from tandem.runner.launch import cpu_group

    # Gathered on the gloo group: the default group is NCCL when the model is on a GPU.
    trace = gather_trace(runner.tracer, group if group is not None else cpu_group())
    if trace is not None:
        import sys

        print(f"[tandem] wrote overlap trace {write_trace(path, trace)}", file=sys.stderr, flush=True)
