"""What one rank runs in a benchmark step, and how one step is timed across ranks.

Two workloads, same interface:

- `ModelStepWorkload`: one `ModelRunner.execute` of a real model (`tiny-moe` or a Hugging
  Face directory) on a decode batch (T requests of one token over a `context_len` cache)
  or a prefill batch (requests of up to `prefill_len` new tokens), exactly the path
  `tandem serve` runs. Its floor comes from the runtime's time model of the no-overlap
  step: communication = the exposed receive waits of the rank that waited least (so load
  skew between ranks is not counted as communication), compute = the rest, on the slowest
  rank.
- `MoEStackWorkload` (`--model moe-stack`): a stack of MoE layers (attention stand-in,
  routed top-k experts, one shared expert) whose floor is measured directly: a
  compute-only step (experts local, no all-to-all) and a communication-only step (zero-cost
  experts, no attention). It has no attention over a KV cache, so `--phase` only picks
  the strategy of the `tbo` mode (SGLang's decode, delta 2, or prefill, delta 0).

Every step starts after a barrier; its time is the slowest rank's. The time model
(compute, receive wait, communication, switch) is gathered from every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tandem.bench.modes import MODES, PHASES, mode_flags, mode_overlap
from tandem.bench.moe_stack import MOE_STACK, MoEStack
from tandem.config import OverlapConfig
from tandem.contexts import StageExecutor, StepTimes, make_executor
from tandem.modular_kernels import FabricModel, FusedMoEModularKernel
from tandem.worker.ubatch_wrapper import eager_unless_asked


@dataclass
class Sample:
    """One timed step: the slowest rank's wall time and every rank's time model."""

    step_s: float
    per_rank: list[StepTimes]

    @property
    def mean_times(self) -> StepTimes:
        return StepTimes.mean(self.per_rank)

    @property
    def floor_compute_s(self) -> float:
        return max(t.compute_s + t.switch_s for t in self.per_rank)

    @property
    def floor_comm_s(self) -> float:
        return min(t.recv_wait_s for t in self.per_rank)


def _gather(times: StepTimes, distributed: bool) -> Sample:
    mine = torch.tensor(times.as_tuple(), dtype=torch.float64)
    if not distributed:
        return Sample(times.step_s, [times])
    from tandem.distributed.launch import cpu_group

    world = dist.get_world_size()
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=cpu_group())  # CPU tensors: the gloo group, whatever the device
    per_rank = [StepTimes(*t.tolist()) for t in everyone]
    return Sample(max(t.step_s for t in per_rank), per_rank)


def _barrier(distributed: bool) -> None:
    if distributed:
        from tandem.distributed.launch import cpu_group

        dist.barrier(group=cpu_group())


def _kernels(model) -> list[FusedMoEModularKernel]:
    return [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), FusedMoEModularKernel)]


class ModelStepWorkload:
    """One `ModelRunner` step of the model in `config` on this rank."""

    def __init__(self, config, *, phase: str, context_len: int, prefill_len: int, max_tokens: int, distributed: bool):
        from tandem.engine.offline import build_runner
        from tandem.worker.sampling import SamplingParams

        if phase not in PHASES:
            raise ValueError(f"--phase must be one of {PHASES}, got {phase!r}")
        self.phase, self.context_len, self.prefill_len = phase, context_len, prefill_len
        self.distributed = distributed
        bs = config.cache.block_size
        if phase == "decode":
            per_request, num_requests = -(-(context_len + 1) // bs), max_tokens
        else:
            per_request, num_requests = -(-prefill_len // bs), -(-max_tokens // prefill_len)
        blocks = per_request * num_requests + 1  # + the runner's null block
        config = replace(
            config,
            cache=replace(config.cache, num_kv_blocks=max(blocks, config.cache.num_kv_blocks)),
            max_num_batched_tokens=max(config.max_num_batched_tokens, max_tokens),
            overlap=eager_unless_asked(config.overlap),  # the modes compared, step by step
        )
        self.runner = build_runner(config, group=dist.group.WORLD if distributed else None)
        self.base_overlap = config.overlap
        self.kernels = _kernels(self.runner.model)
        self.executors = {kind: make_executor(kind) for kind in ("thread", "greenlet")}
        self.executors["stages"] = StageExecutor()
        self.request_blocks = [self.runner.allocator.allocate(per_request) for _ in range(num_requests)]
        self.params = SamplingParams(max_tokens=1)
        self.vocab = 200  # byte ids: valid for every model's vocabulary

    @property
    def num_moe_layers(self) -> int:
        return len(self.kernels)

    def set_fabric(self, fabric: FabricModel | None) -> None:
        if self.runner.device.type == "cuda" and not self.distributed:
            # One GPU: each transfer becomes a spin kernel on the comm stream (real streams).
            from tandem.modular_kernels.device_fabric import install_device_fabric

            install_device_fabric(self.runner.model, fabric)
            return
        for k in self.kernels:
            if hasattr(k.prepare_finalize, "fabric"):
                k.prepare_finalize.fabric = fabric

    def _chunks(self, tokens: int):
        from tandem.worker.step_inputs import ScheduledChunk

        g = torch.Generator().manual_seed(tokens)
        if self.phase == "decode":
            ids = torch.randint(0, self.vocab, (tokens,), generator=g).tolist()
            return [ScheduledChunk([ids[r]], self.context_len, self.request_blocks[r]) for r in range(tokens)]
        chunks, left, r = [], tokens, 0
        while left > 0:
            n = min(left, self.prefill_len)
            chunks.append(ScheduledChunk(torch.randint(0, self.vocab, (n,), generator=g).tolist(), 0, self.request_blocks[r]))
            left, r = left - n, r + 1
        return chunks

    def set_tracer(self, tracer) -> None:
        self.runner.tracer = tracer

    def measure(self, mode: str, tokens: int) -> Sample:
        _, _, sbo = mode_flags(mode)
        if self.runner.tracer is not None:
            self.runner.tracer.tags = {"mode": mode}
        # The mode's SBO is the runner's per-step choice; its SBO variant is the kernels' setting.
        self.runner.sbo = sbo is not None
        for k in self.kernels:
            k.sbo_mode = sbo or "auto"
        return self.run_step(mode_overlap(self.base_overlap, mode), self._chunks(tokens))

    def run_step(self, overlap: OverlapConfig, chunks) -> Sample:
        """One step of `chunks` (this rank's `ScheduledChunk`s) under `overlap`."""
        self.runner.overlap = overlap
        self.runner.wrapper.executor = self.executors[overlap.executor]
        _barrier(self.distributed)
        self.runner.execute(chunks, [self.params] * len(chunks), [None] * len(chunks))
        return _gather(self.runner.last_step_times, self.distributed)

    def floor(self, tokens: int, none_sample: Sample | None = None) -> tuple[float, float]:
        """(compute s, communication s) from the no-overlap step's time model."""
        sample = none_sample or self.measure("none", tokens)
        return sample.floor_compute_s, sample.floor_comm_s


class MoEStackWorkload:
    def __init__(
        self, rank: int, world: int, *, backend: str, num_ubatches: int, executor: str = "thread", phase: str = "decode",
        thresholds_file: str | None = None, **shape,
    ):
        self.stack = MoEStack(rank, world, backend=backend, num_ubatches=num_ubatches, executor=executor, phase=phase, **shape)
        self.base_overlap = OverlapConfig(num_ubatches=num_ubatches).with_thresholds_file(thresholds_file)
        self.distributed = world > 1
        self.fabric: FabricModel | None = None
        self.num_moe_layers = self.stack.cfg["layers"]

    def set_fabric(self, fabric: FabricModel | None) -> None:
        self.fabric = fabric

    def set_tracer(self, tracer) -> None:
        self.stack.tracer = tracer

    def measure(self, mode: str, tokens: int) -> Sample:
        """One step of a bench mode (each agrees with the other ranks first, as the runtime's
        steps do) or of a floor part (`compute`, `comm`: the step's work alone, no agreement)."""
        if mode == "auto":
            return self.run_overlap(mode_overlap(self.base_overlap, mode), tokens)
        _barrier(self.distributed)
        if mode in MODES or mode == "dbo-shared@dispatch":  # a DBO variant: it agrees as dbo does
            overlap = mode_overlap(self.base_overlap, mode if mode in MODES else "dbo")
            times = self.stack.step_static(mode, overlap, tokens, self.fabric)
        else:
            times = self.stack.step(mode, tokens, self.fabric)
        return _gather(times, self.distributed)

    def run_overlap(self, overlap: OverlapConfig, tokens: int) -> Sample:
        _barrier(self.distributed)
        return _gather(self.stack.step_overlap(overlap, tokens, self.fabric), self.distributed)

    def floor(self, tokens: int, none_sample: Sample | None = None) -> tuple[float, float]:
        """(compute s, communication s), each its own step."""
        return self.measure("compute", tokens).step_s, self.measure("comm", tokens).step_s


__all__ = ["MODES", "MOE_STACK", "PHASES", "MoEStack", "MoEStackWorkload", "ModelStepWorkload", "Sample", "mode_overlap"]
