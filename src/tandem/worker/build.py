"""Setting up and closing one rank's model runner: load its share of the model (its experts,
its pipeline stage's layers) on its device, and hand its overlap trace to rank 0 at the end.
Every process kind (offline generation, serving ranks, pipeline stages, the bench) builds
its runner here."""

from __future__ import annotations

from tandem.worker.model_runner import ModelRunner


def build_runner(config, *, group=None, cpu_group=None, stage=None) -> ModelRunner:
    """Load `config.model` for this rank (its experts only; with `stage`, a
    `tandem.distributed.StageLayers`, only that pipeline stage's layers) on the rank's device
    and wrap it in a ModelRunner. `group` carries the model's tensor collectives (the device
    group); `cpu_group` the step decisions over the same ranks (default: `group` itself when it
    is a gloo group, `launch.cpu_group()` when `group` is the whole world)."""
    import torch.distributed as dist

    from tandem.models.loader import load_model
    from tandem.distributed.launch import cpu_group as default_cpu_group, local_rank

    if group is not None and cpu_group is None:
        if dist.get_backend(group) == "gloo":
            cpu_group = group
        elif dist.get_world_size(group) == dist.get_world_size():
            cpu_group = default_cpu_group()
        else:
            # The world's CPU group would wait for ranks that never join this group's steps.
            raise ValueError("build_runner: a device group smaller than the world needs its own gloo cpu_group")
    device = config.resolve_device(local_rank(dist.get_rank() if dist.is_initialized() else 0))
    info = load_model(config.model, moe=config.moe_config(group), dtype=config.resolve_dtype(device), device=device, stage=stage)
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
        config=config,
    )


def write_rank_trace(runner: ModelRunner, path: str | None, group=None) -> None:
    """`--trace`: every rank hands its timeline to rank 0 of `group`, which writes `path`."""
    if runner.tracer is None or path is None:
        return
    from tandem.contexts.trace import gather_trace, write_trace
    from tandem.distributed.launch import cpu_group

    # Gathered on the gloo group: the default group is NCCL when the model is on a GPU.
    trace = gather_trace(runner.tracer, group if group is not None else cpu_group())
    if trace is not None:
        import sys

        print(f"[tandem] wrote overlap trace {write_trace(path, trace)}", file=sys.stderr, flush=True)
