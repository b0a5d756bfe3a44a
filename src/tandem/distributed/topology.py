"""Process topology: world = PP x DP. Global rank `r` is pipeline stage `r // D`, data-parallel
rank `r % D` of that stage, so stage 0 (the scheduling stage) holds ranks `0 .. D-1` and the
head is rank 0. The MoE layers of a stage are expert-parallel over the stage's D ranks; the
micro-batches of DP column `d` flow `stage 0 -> 1 -> ... -> P-1` on ranks `s * D + d` and
the last stage relays the sampled ids back to rank `d` (a ring).

Groups (`init_stage_groups`, called by every rank in the same order, as torch.distributed
requires for `new_group`):

- `dp_group`: the stage's D ranks on the device backend (EP all-to-alls, DP agreement);
  `dp_cpu_group` the same ranks on gloo (host-side step decisions);
- `device_group`: the world on the device backend, for the tensors between stages;
- `cpu_group`: the world on gloo, for the metadata between stages (keys, shapes, dtypes,
  non-tensor values), so no host value ever rides the device group;
- `first_stage_cpu_group`: gloo over the first stage (the scheduling ranks' control plane).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.platform.device import device_group_backend


@dataclass(frozen=True)
class Topology:
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} (PP {self.pipeline_parallel_size} x DP {self.data_parallel_size})")

    def stage_of(self, rank: int) -> int:
        self._check(rank)
        return rank // self.data_parallel_size

    def dp_rank_of(self, rank: int) -> int:
        self._check(rank)
        return rank % self.data_parallel_size

    def rank_of(self, stage: int, dp_rank: int) -> int:
        if not (0 <= stage < self.pipeline_parallel_size and 0 <= dp_rank < self.data_parallel_size):
            raise ValueError(f"no rank at stage {stage}, dp rank {dp_rank} in PP {self.pipeline_parallel_size} x DP {self.data_parallel_size}")
        return stage * self.data_parallel_size + dp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, d) for d in range(self.data_parallel_size)]

    def next_rank(self, rank: int) -> int:
        """Where `rank` sends its micro-batches: the next stage, the last one back to the first."""
        stage = (self.stage_of(rank) + 1) % self.pipeline_parallel_size
        return self.rank_of(stage, self.dp_rank_of(rank))

    def prev_rank(self, rank: int) -> int:
        stage = (self.stage_of(rank) - 1) % self.pipeline_parallel_size
        return self.rank_of(stage, self.dp_rank_of(rank))

    def is_first_stage(self, rank: int) -> bool:
        return self.stage_of(rank) == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.stage_of(rank) == self.pipeline_parallel_size - 1

    def describe(self, rank: int) -> str:
        """`rank 3 (pipeline stage 1, dp rank 1)`; just `rank 3` without PP."""
        if self.pipeline_parallel_size == 1:
            return f"rank {rank}"
        return f"rank {rank} (pipeline stage {self.stage_of(rank)}, dp rank {self.dp_rank_of(rank)})"


@dataclass
class StageGroups:
    topology: Topology
    rank: int
    dp_group: object
    device_group: object
    cpu_group: object
    #: gloo over the first stage's ranks: the control plane of the scheduling ranks.
    first_stage_cpu_group: object = None
    #: gloo over this stage's DP ranks: host-side step decisions of the stage.
    dp_cpu_group: object = None

    @property
    def stage(self) -> int:
        return self.topology.stage_of(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank_of(self.rank)


def init_stage_groups(topology: Topology, *, device: torch.device | str = "cpu", timeout_s: float = 600.0) -> StageGroups:
    """Build the groups of the calling rank (the default group must be up, over the whole
    world). Every rank calls this once, with the same arguments."""
    if not dist.is_initialized():
        raise RuntimeError("init_stage_groups needs the default process group (torch.distributed.init_process_group)")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise ValueError(
            f"the process group has {world} ranks but PP {topology.pipeline_parallel_size} x DP "
            f"{topology.data_parallel_size} needs {topology.world_size}"
        )
    rank = dist.get_rank()
    backend = device_group_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dp_group = dp_cpu_group = None
    for stage in range(topology.pipeline_parallel_size):
        group = dist.new_group(topology.stage_ranks(stage), backend=backend, timeout=timeout)
        cpu = dist.new_group(topology.stage_ranks(stage), backend="gloo", timeout=timeout)
        if stage == topology.stage_of(rank):
            dp_group, dp_cpu_group = group, cpu
    default_is_device = dist.get_backend() == backend
    device_group = dist.group.WORLD if default_is_device else dist.new_group(backend=backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    first_stage_cpu_group = dist.new_group(topology.stage_ranks(0), backend="gloo", timeout=timeout)
    return StageGroups(topology, rank, dp_group, device_group, cpu_group, first_stage_cpu_group, dp_cpu_group)


__all__ = ["StageGroups", "Topology", "init_stage_groups"]
