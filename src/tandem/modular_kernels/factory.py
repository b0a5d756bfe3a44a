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

#: The dispatch options each backend uses; any other one given to it is refused, so no
#: setting is silently dropped. `dispatch_max_tokens_per_rank` sizes a fixed per-rank buffer,
#: `fabric` models the interconnect's time, `comm_sms` are the SMs DeepEP's kernels get.
#: (fp8 dispatch and SBO work with every backend.)
DISPATCH_OPTIONS = {
    "local": frozenset(),
    "torch_a2a": frozenset({"fabric"}),
    "torch_a2a_ll": frozenset({"dispatch_max_tokens_per_rank", "fabric"}),
    "deepep_low_latency": frozenset({"dispatch_max_tokens_per_rank", "fabric", "comm_sms"}),
    "deepep_high_throughput": frozenset({"fabric", "comm_sms"}),
}

#: What the options are called on the command line, for the error message.
_OPTION_FLAGS = {
    "dispatch_max_tokens_per_rank": "--dispatch-max-tokens-per-rank",
    "fabric": "--fabric / --fabric-latency-us / --fabric-gbps",
    "comm_sms": "--comm-sms",
}


def check_dispatch_options(all2all_backend: str, **options) -> None:
    """Raise a ValueError naming an option (given: not None) that `all2all_backend` would ignore."""
    if all2all_backend not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {all2all_backend!r}: expected one of {sorted(ALL2ALL_BACKENDS)}")
    accepted = DISPATCH_OPTIONS[all2all_backend]
    for name, value in options.items():
        if value is None or name in accepted:
            continue
        users = [b for b, names in DISPATCH_OPTIONS.items() if name in names]
        raise ValueError(
            f"{name} ({_OPTION_FLAGS.get(name, name)}) has no effect on the {all2all_backend!r} all2all backend; "
            f"only {', '.join(users)} use{'s' if len(users) == 1 else ''} it"
        )


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


def default_dispatch_budget(all2all_backend: str, max_num_batched_tokens: int | None) -> int | None:
    """The dispatch token budget when none is given: a whole step for torch_a2a_ll (it never
    overflows), DeepEP's 128 for deepep_low_latency (its buffer and queue pairs grow with it),
    None for the backends without a fixed buffer."""
    if all2all_backend == "torch_a2a_ll":
        return max_num_batched_tokens
    if all2all_backend == "deepep_low_latency":
        return DEFAULT_LL_MAX_TOKENS_PER_RANK
    return None


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
    dispatch_max_tokens_per_rank: int | None,
    fabric: FabricModel | None,
    comm_sms: int | None,
    hidden_size: int,
) -> PrepareAndFinalize:
    check_dispatch_options(name, dispatch_max_tokens_per_rank=dispatch_max_tokens_per_rank, fabric=fabric, comm_sms=comm_sms)
    cls = _load(ALL2ALL_BACKENDS[name])
    if name == "local":
        if group is not None and torch.distributed.get_world_size(group) > 1:
            raise ValueError("the 'local' all2all backend runs one rank; use torch_a2a or torch_a2a_ll with a group")
        return cls(num_experts)
    if group is None and not torch.distributed.is_initialized():
        raise ValueError(f"all2all backend {name!r} needs an initialised torch.distributed process group")
    kwargs = {"group": group, "fabric": fabric}
    if "dispatch_max_tokens_per_rank" in DISPATCH_OPTIONS[name]:
        budget = dispatch_max_tokens_per_rank
        kwargs["max_tokens_per_rank"] = budget if budget is not None else default_dispatch_budget(name, None)
    if name == "deepep_high_throughput":
        kwargs["comm_sms"] = comm_sms
    if name.startswith("deepep_"):
        # The Buffer (a collective plus NVSHMEM init) is made now, at model build, not inside
        # the first (maybe ubatched) forward; the hidden size is checked here too.
        kwargs["hidden_size"] = hidden_size
    return cls(num_experts, **kwargs)


def _make_experts(
    name: str, activation_format: ActivationFormat, *, top_k: int | None = None, num_experts: int | None = None
) -> Experts:
    """The `name` experts in `activation_format`; `top_k` and `num_experts` (global) go to
    the backends whose kernels take a load hint (deep_gemm's `expected_m`)."""
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown moe backend {name!r}: expected one of {sorted(MOE_BACKENDS)}")
    by_format = MOE_BACKENDS[name]
    if activation_format not in by_format:
        supported = ", ".join(f.value for f in by_format)
        raise ValueError(
            f"moe backend {name!r} has no {activation_format.value} implementation (it supports: {supported})"
        )
    cls = _load(by_format[activation_format])
    if name == "deep_gemm":
        return cls(top_k=top_k, num_experts=num_experts)
    return cls()


def build_moe_kernel(
    all2all_backend: str,
    moe_backend: str,
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    group=None,
    dispatch_max_tokens_per_rank: int | None = None,
    shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    use_fp8_dispatch: bool = False,
    enable_sbo: bool = False,
    sbo_mode: str = "auto",
    comm_sms: int | None = None,
    fabric: FabricModel | None = None,
    deepep_ll_max_tokens_per_rank: int | None = None,
) -> FusedMoEModularKernel:
    """Rank r of the R ranks in `group` holds experts `[r*E/R, (r+1)*E/R)`; `forward` takes
    that rank's local weights and global expert ids.

    `dispatch_max_tokens_per_rank` is the dispatch's token budget, used by the fixed-buffer
    backends (torch_a2a_ll, deepep_low_latency; None: `default_dispatch_budget`, and
    torch_a2a_ll then needs one); `deepep_ll_max_tokens_per_rank` is its deprecated name. A
    dispatch option the chosen backend would ignore is a ValueError naming it. `sbo_mode` (with `enable_sbo`) is one of
    `tandem.modular_kernels.sbo.SBO_MODES`. `comm_sms` (`--comm-sms`) is the SMs given to
    communication: deepep_high_throughput's buffer is sized for them, and under SBO they go to
    the combine while the down projection overlaps it."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    check_sbo_mode(sbo_mode)
    dispatch_max_tokens_per_rank = resolve_budget_alias(dispatch_max_tokens_per_rank, deepep_ll_max_tokens_per_rank)
    if use_fp8_dispatch and hidden_size % 128:
        raise ValueError(f"fp8 dispatch needs hidden_size divisible by 128, got {hidden_size}")
    prepare_finalize = _make_prepare_finalize(
        all2all_backend,
        num_experts=num_experts,
        group=group,
        dispatch_max_tokens_per_rank=dispatch_max_tokens_per_rank,
        fabric=fabric,
        comm_sms=comm_sms,
        hidden_size=hidden_size,
    )
    experts = _make_experts(moe_backend, prepare_finalize.activation_format, top_k=top_k, num_experts=num_experts)
    return FusedMoEModularKernel(
        prepare_finalize,
        experts,
        shared_experts,
        use_fp8_dispatch=use_fp8_dispatch,
        enable_sbo=enable_sbo,
        sbo_mode=sbo_mode,
        comm_sms=comm_sms,
    )
