"""`build_engine(config)`: this rank's part of the engine `config` describes, for every caller
(serve's ranks, `tandem generate`, the benchmarks). The one place that maps the config tree
onto an `Engine`: its scheduler section, the step token budget, lockstep with the DP peers,
dynamic chunking, and with pipeline parallelism which stage this rank is.

Without pipeline parallelism every rank gets an `Engine`. With it, the first stage's ranks
get a `PipelineEngine` and the later stages a `LaterStage`, which has no scheduler: its
`run()` serves micro-batches until the first stage says stop. The default process group (if
any) must be up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.distributed import StageGroups
from tandem.engine.core import Engine
from tandem.engine.pipeline import PipelineEngine, StageCounters, run_stage
from tandem.engine.pipeline_choice import pipeline_verdict
from tandem.worker.model_runner import ModelRunner


@dataclass
class LaterStage:
    """A pipeline stage after the first: it runs layers on what the stage before sends."""

    runner: ModelRunner
    groups: StageGroups
    config: EngineConfig
    #: See `Engine.takes_requests`: this stage runs what the stage before sends (`run`).
    takes_requests = False

    def trace_group(self, control):
        """Every stage's timeline goes into one `--trace` file, gathered over all ranks."""
        from tandem.distributed.launch import cpu_group

        return cpu_group()

    def run(self, on_message=None) -> StageCounters:
        """Serve micro-batches until the first stage says stop; `on_message()` is called on
        every message (a watchdog beat). Returns the stage's counters."""
        return run_stage(
            self.runner, self.groups, num_micro_batches=self.config.parallel.num_micro_batches,
            step_timeout_s=self.config.scheduler.step_timeout_s, on_message=on_message,
        )


def build_engine(
    config: EngineConfig, *, runner: ModelRunner | None = None, collective_timeout_s: float = 600.0
) -> Engine | LaterStage:
    """This rank's engine for `config`: a `LaterStage` on a pipeline stage after the first,
    else an `Engine` (a `PipelineEngine` on the first stage). `runner`: one already built
    for `config` (no pipeline parallelism); `collective_timeout_s`: how long the pipeline's
    stage groups wait for a peer when they are made."""
    if config.parallel.pipeline_parallel_size > 1:
        if runner is not None:
            raise ValueError("build_engine builds each pipeline stage's runner itself")
        return _pipeline_stage(config, collective_timeout_s)
    import torch.distributed as dist

    from tandem.distributed.launch import cpu_group
    from tandem.worker.build import build_runner

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if runner is None:
        # The model's collectives run on the device group, its step decisions on the CPU group.
        runner = build_runner(config, group=dist.group.WORLD if distributed else None, cpu_group=cpu_group())
    group = runner.dp_group
    lockstep = group is not None and dist.get_world_size(group) > 1
    engine = Engine(runner, config.scheduler, max_num_batched_tokens=config.max_num_batched_tokens, lockstep=lockstep)
    if config.parallel.enable_dynamic_chunking:
        from tandem.engine.chunking import fit_chunker

        engine.scheduler.chunk_limit = fit_chunker(runner, config.max_num_batched_tokens)
    return engine


def _pipeline_stage(config: EngineConfig, collective_timeout_s: float) -> PipelineEngine | LaterStage:
    runner, groups = build_pipeline_stage(config, timeout_s=collective_timeout_s)
    if groups.stage != 0:
        return LaterStage(runner, groups, config)
    par = config.parallel
    engine = PipelineEngine(
        runner, groups, config.scheduler, num_micro_batches=par.num_micro_batches,
        max_num_batched_tokens=config.max_num_batched_tokens, lockstep=par.data_parallel_size > 1,
    )
    # Its start-up line measures the ring against one micro-batch in flight and keeps the faster.
    engine.startup_note = functools.partial(pipeline_verdict, engine)
    if par.enable_dynamic_chunking:
        from tandem.engine.chunking import fit_chunker

        # Only this stage's layers are timed: the stages are assumed balanced.
        engine.scheduler.chunk_limit = fit_chunker(runner, config.max_num_batched_tokens, engine.worker.forward_first)
    return engine


def build_pipeline_stage(config: EngineConfig, *, timeout_s: float = 600.0) -> tuple[ModelRunner, StageGroups]:
    """This rank's groups and its stage's model (its layers, and its experts of the MoE
    layers sharded over the stage's DP ranks)."""
    import torch.distributed as dist

    from tandem.distributed import Topology, init_stage_groups, stage_layers
    from tandem.distributed.launch import local_rank
    from tandem.models.loader import num_hidden_layers
    from tandem.worker.build import build_runner

    par = config.parallel
    device = config.resolve_device(local_rank(dist.get_rank()))
    topology = Topology(par.pipeline_parallel_size, par.data_parallel_size)
    groups = init_stage_groups(topology, device=device, timeout_s=timeout_s)
    stage = stage_layers(num_hidden_layers(config.model), groups.stage, par.pipeline_parallel_size, par.pp_layer_partition)
    # The stage's DP agreement runs on its own gloo group: the other stages never join it.
    return build_runner(config, group=groups.dp_group, cpu_group=groups.dp_cpu_group, stage=stage), groups


__all__ = ["LaterStage", "build_engine", "build_pipeline_stage"]
