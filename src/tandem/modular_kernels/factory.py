"""`build_moe_kernel`: the one place that turns backend names into a kernel."""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from tandem.modular_kernels.fabric import FabricModel
from tandem.modular_kernels.interfaces import ActivationFormat, Experts, PrepareAndFinalize
from tandem.modular_kernels.kernel import FusedMoEModularKernel
from tandem.modular_kernels.prepare_deepep import DEFAULT_LL_MAX_TOKENS_PER_RANK
from tandem.modular_kernels.sbo import check_sbo_mode

#: --all2all-backend choices → "module:class" (imported lazily: some need GPU libraries).
ALL2ALL_BACKENDS = {
    "local": "tandem.modular_kernels.prepare_local:LocalPrepareAndFinalize",
    "torch_a2a": "tandem.modular_kernels.prepare_torch_a2a:TorchAllToAllPrepareAndFinalize",
    "torch_a2a_ll": "tandem.modular_kernels.prepare_torch_a2a_ll:TorchLowLatencyPrepareAndFinalize",
    "deepep_low_latency": "tandem.modular_kernels.prepare_deepep:DeepEPLowLatencyPrepareAndFinalize",
    "deepep_high_throughput": "tandem.modular_kernels.prepare_deepep:DeepEPHighThroughputPrepareAndFinalize",
}

#: --moe-backend choices → the implementation per activation format.
MOE_BACKENDS = {
    "torch": {
        ActivationFormat.STANDARD: "tandem.modular_kernels.experts_torch:TorchExperts",
        ActivationFormat.MASKED: "tandem.modular_kernels.experts_torch:TorchBatchedExperts",
    },
    "triton": {
        ActivationFormat.STANDARD: "tandem.modular_kernels.experts_triton:TritonExperts",
        ActivationFormat.MASKED: "tandem.modular_kernels.experts_triton:TritonBatchedExperts",
    },
    "deep_gemm": {
        ActivationFormat.STANDARD: "tandem.modular_kernels.experts_deep_gemm:DeepGemmExperts",
        ActivationFormat.MASKED: "tandem.modular_kernels.experts_deep_gemm:DeepGemmBatchedExperts",
    },
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _make_prepare_finalize(
    name: str,
    *,
    num_experts: int,
    group,
    max_tokens_per_rank: int | None,
    fabric: FabricModel | None,
    deepep_ll_max_tokens_per_rank: int,
    comm_sms: int | None,
    hidden_size: int,
) -> PrepareAndFinalize:
    if name not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {name!r}: expected one of {sorted(ALL2ALL_BACKENDS)}")
    cls = _load(ALL2ALL_BACKENDS[name])
    if name == "local":
        if group is not None and torch.distributed.get_world_size(group) > 1:
            raise ValueError("the 'local' all2all backend runs one rank; use torch_a2a or torch_a2a_ll with a group")
        if fabric is not None:
            raise ValueError("a modelled fabric needs a communicating all2all backend, not 'local'")
        return cls(num_experts)
    if group is None and not torch.distributed.is_initialized():
        raise ValueError(f"all2all backend {name!r} needs an initialised torch.distributed process group")
    kwargs = {"group": group, "fabric": fabric}
    if name == "torch_a2a_ll":
        kwargs["max_tokens_per_rank"] = max_tokens_per_rank
    elif name == "deepep_low_latency":
        # Its own budget: DeepEP's buffer and queue-pair limits grow with it (see prepare_deepep).
        kwargs["max_tokens_per_rank"] = deepep_ll_max_tokens_per_rank
    elif name == "deepep_high_throughput":
        kwargs["comm_sms"] = comm_sms
    if name.startswith("deepep_"):
        # The Buffer (a collective plus NVSHMEM init) is made now, at model build, not inside
        # the first (maybe ubatched) forward; the hidden size is checked here too.
        kwargs["hidden_size"] = hidden_size
    return cls(num_experts, **kwargs)


def _make_experts(name: str, activation_format: ActivationFormat) -> Experts:
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown moe backend {name!r}: expected one of {sorted(MOE_BACKENDS)}")
    by_format = MOE_BACKENDS[name]
    if activation_format not in by_format:
        supported = ", ".join(f.value for f in by_format)
        raise ValueError(
            f"moe backend {name!r} has no {activation_format.value} implementation (it supports: {supported})"
        )
    return _load(by_format[activation_format])()


def build_moe_kernel(
    all2all_backend: str,
    moe_backend: str,
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    group=None,
    max_tokens_per_rank: int | None = None,
    shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    use_fp8_dispatch: bool = False,
    enable_sbo: bool = False,
    sbo_mode: str = "auto",
    comm_sms: int | None = None,
    fabric: FabricModel | None = None,
    deepep_ll_max_tokens_per_rank: int = DEFAULT_LL_MAX_TOKENS_PER_RANK,
) -> FusedMoEModularKernel:
    """Rank r of the R ranks in `group` holds experts `[r*E/R, (r+1)*E/R)`; `forward` takes
    that rank's local weights and global expert ids.

    `max_tokens_per_rank` is torch_a2a_ll's budget, `deepep_ll_max_tokens_per_rank`
    deepep_low_latency's. `sbo_mode` (with `enable_sbo`) is one of
    `tandem.modular_kernels.sbo.SBO_MODES`. `comm_sms` (`--comm-sms`) is the SMs given to
    communication: deepep_high_throughput's buffer is sized for them, and under SBO they go to
    the combine while the down projection overlaps it."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    check_sbo_mode(sbo_mode)
    if use_fp8_dispatch and hidden_size % 128:
        raise ValueError(f"fp8 dispatch needs hidden_size divisible by 128, got {hidden_size}")
    prepare_finalize = _make_prepare_finalize(
        all2all_backend,
        num_experts=num_experts,
        group=group,
        max_tokens_per_rank=max_tokens_per_rank,
        fabric=fabric,
        deepep_ll_max_tokens_per_rank=deepep_ll_max_tokens_per_rank,
        comm_sms=comm_sms,
        hidden_size=hidden_size,
    )
    experts = _make_experts(moe_backend, prepare_finalize.activation_format)
    return FusedMoEModularKernel(
        prepare_finalize,
        experts,
        shared_experts,
        use_fp8_dispatch=use_fp8_dispatch,
        enable_sbo=enable_sbo,
        sbo_mode=sbo_mode,
        comm_sms=comm_sms,
    )
