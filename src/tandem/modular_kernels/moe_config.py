"""`MoEConfig`: how a model's MoE layers communicate and compute, one object from
`EngineConfig.moe_config` to every layer's kernel. Each dispatch backend declares the options it
reads and builds itself from it (`PrepareAndFinalize.from_moe_config`), as each experts backend
does (`Experts.from_moe_config`); `build_moe_kernel` is the keyword entry for code without one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.factory import check_dispatch_options, check_moe_backend, experts_class, prepare_class
from tandem.modular_kernels.kernel import FusedMoEModularKernel
from tandem.modular_kernels.sbo import check_sbo_mode


@dataclass(frozen=True)
class MoEConfig:
    """Rank r of the R ranks in `group` (expert parallelism) holds experts `[r*E/R, (r+1)*E/R)`.
    Every option is checked against the chosen backends when the config is made."""

    all2all_backend: str = "local"
    moe_backend: str = "torch"
    group: object = None
    #: Tokens one rank may send per dispatch, for the fixed-buffer backends (torch_a2a_ll,
    #: deepep_low_latency); None: the backend's `default_dispatch_budget` (torch_a2a_ll has none
    #: without a step size, so it then needs one).
    dispatch_max_tokens_per_rank: int | None = None
    use_fp8_dispatch: bool = False
    enable_sbo: bool = False
    #: One of `tandem.modular_kernels.sbo.SBO_MODES`, used with `enable_sbo`.
    sbo_mode: str = "auto"
    #: A modelled interconnect whose time the transfers take (a what-if, not a measurement).
    fabric: FabricModel | None = None
    #: `--comm-sms`: the SMs communication gets. deepep_high_throughput's buffer is sized for
    #: them, and under SBO they go to the combine while the down projection overlaps it.
    comm_sms: int | None = None

    def __post_init__(self) -> None:
        check_moe_backend(self.moe_backend)
        check_sbo_mode(self.sbo_mode)
        check_dispatch_options(
            self.all2all_backend,
            dispatch_max_tokens_per_rank=self.dispatch_max_tokens_per_rank,
            fabric=self.fabric,
            comm_sms=self.comm_sms,
        )

    @property
    def ep_rank(self) -> int:
        return torch.distributed.get_rank(self.group) if self._distributed else 0

    @property
    def ep_size(self) -> int:
        return torch.distributed.get_world_size(self.group) if self._distributed else 1

    @property
    def _distributed(self) -> bool:
        return self.all2all_backend != "local" and torch.distributed.is_initialized()

    def local_experts(self, num_experts: int) -> range:
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not divide over {self.ep_size} expert-parallel ranks")
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def build_kernel(
        self,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> FusedMoEModularKernel:
        """One layer's kernel; `forward` takes this rank's local weights and global expert ids."""
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
        if self.use_fp8_dispatch and hidden_size % 128:
            raise ValueError(f"fp8 dispatch needs hidden_size divisible by 128, got {hidden_size}")
        prepare_finalize = prepare_class(self.all2all_backend).from_moe_config(
            self, num_experts=num_experts, hidden_size=hidden_size
        )
        experts = experts_class(self.moe_backend, prepare_finalize.activation_format).from_moe_config(
            self, num_experts=num_experts, top_k=top_k
        )
        return FusedMoEModularKernel(
            prepare_finalize,
            experts,
            shared_experts,
            use_fp8_dispatch=self.use_fp8_dispatch,
            enable_sbo=self.enable_sbo,
            sbo_mode=self.sbo_mode,
            comm_sms=self.comm_sms,
        )


def build_moe_kernel(
    all2all_backend: str,
    moe_backend: str,
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    deepep_ll_max_tokens_per_rank: int | None = None,
    **options,
) -> FusedMoEModularKernel:
    """`MoEConfig(all2all_backend, moe_backend, **options).build_kernel(...)`: one kernel
    without a config object (tests, the bench). `options` are `MoEConfig`'s fields;
    `deepep_ll_max_tokens_per_rank` is the deprecated name of `dispatch_max_tokens_per_rank`."""
    options["dispatch_max_tokens_per_rank"] = resolve_budget_alias(
        options.get("dispatch_max_tokens_per_rank"), deepep_ll_max_tokens_per_rank
    )
    config = MoEConfig(all2all_backend, moe_backend, **options)
    return config.build_kernel(num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, shared_experts=shared_experts)


def resolve_budget_alias(dispatch_max_tokens_per_rank: int | None, deepep_ll_max_tokens_per_rank: int | None) -> int | None:
    """The dispatch token budget given under either name: `deepep_ll_max_tokens_per_rank`
    (`--deepep-ll-max-tokens-per-rank`) is the deprecated name of `dispatch_max_tokens_per_rank`
    (`--dispatch-max-tokens-per-rank`); two different values are an error."""
    if deepep_ll_max_tokens_per_rank is None:
        return dispatch_max_tokens_per_rank
    if dispatch_max_tokens_per_rank not in (None, deepep_ll_max_tokens_per_rank):
        raise ValueError(
            "deepep_ll_max_tokens_per_rank (--deepep-ll-max-tokens-per-rank) is the old name of "
            "dispatch_max_tokens_per_rank (--dispatch-max-tokens-per-rank); give one"
        )
    return deepep_ll_max_tokens_per_rank
