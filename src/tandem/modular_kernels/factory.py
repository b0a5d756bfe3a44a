"""The backend registry: `--all2all-backend` and `--moe-backend` names to the classes that
implement them, and the dispatch options each dispatch backend declares. `MoEConfig` builds
kernels from it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from tandem.modular_kernels.interfaces import ActivationFormat, Experts, PrepareAndFinalize

#: --all2all-backend choices → "module:class".
ALL2ALL_BACKENDS = {
    "local": "tandem.modular_kernels.prepare_local:LocalPrepareAndFinalize",
    "torch_a2a": "tandem.modular_kernels.prepare_torch_a2a:TorchAllToAllPrepareAndFinalize",
    "torch_a2a_ll": "tandem.modular_kernels.prepare_torch_a2a_ll:TorchLowLatencyPrepareAndFinalize",
    "deepep_low_latency": "tandem.modular_kernels.prepare_deepep:DeepEPLowLatencyPrepareAndFinalize",
    "deepep_high_throughput": "tandem.modular_kernels.prepare_deepep:DeepEPHighThroughputPrepareAndFinalize",
}

#: --moe-backend choices → the implementation per activation format (imported lazily: some
#: need GPU libraries).
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


def prepare_class(all2all_backend: str) -> type[PrepareAndFinalize]:
    if all2all_backend not in ALL2ALL_BACKENDS:
        raise ValueError(f"unknown all2all backend {all2all_backend!r}: expected one of {sorted(ALL2ALL_BACKENDS)}")
    return _load(ALL2ALL_BACKENDS[all2all_backend])


def experts_class(moe_backend: str, activation_format: ActivationFormat) -> type[Experts]:
    check_moe_backend(moe_backend)
    by_format = MOE_BACKENDS[moe_backend]
    if activation_format not in by_format:
        supported = ", ".join(f.value for f in by_format)
        raise ValueError(
            f"moe backend {moe_backend!r} has no {activation_format.value} implementation (it supports: {supported})"
        )
    return _load(by_format[activation_format])


def check_moe_backend(moe_backend: str) -> None:
    if moe_backend not in MOE_BACKENDS:
        raise ValueError(f"unknown moe backend {moe_backend!r}: expected one of {sorted(MOE_BACKENDS)}")


class _DeclaredDispatchOptions(Mapping):
    """Backend name -> the dispatch options its class declares, each class imported only when
    asked for (a backend's module may need libraries the others do not)."""

    def __getitem__(self, name: str) -> frozenset[str]:
        return prepare_class(name).dispatch_options

    def __iter__(self) -> Iterator[str]:
        return iter(ALL2ALL_BACKENDS)

    def __len__(self) -> int:
        return len(ALL2ALL_BACKENDS)


#: The dispatch options each backend declares (`PrepareAndFinalize.dispatch_options`).
DISPATCH_OPTIONS = _DeclaredDispatchOptions()

#: What the options are called on the command line, for the error message.
_OPTION_FLAGS = {
    "dispatch_max_tokens_per_rank": "--dispatch-max-tokens-per-rank",
    "fabric": "--fabric / --fabric-latency-us / --fabric-gbps",
    "comm_sms": "--comm-sms",
}


def check_dispatch_options(all2all_backend: str, **options) -> None:
    """Raise a ValueError naming an option (given: not None) that `all2all_backend` would ignore."""
    accepted = prepare_class(all2all_backend).dispatch_options
    for name, value in options.items():
        if value is None or name in accepted:
            continue
        users = [b for b, names in DISPATCH_OPTIONS.items() if name in names]
        raise ValueError(
            f"{name} ({_OPTION_FLAGS.get(name, name)}) has no effect on the {all2all_backend!r} all2all backend; "
            f"only {', '.join(users)} use{'s' if len(users) == 1 else ''} it"
        )


def default_dispatch_budget(all2all_backend: str, max_num_batched_tokens: int | None) -> int | None:
    """The dispatch token budget when none is given, as the backend declares it."""
    return prepare_class(all2all_backend).default_dispatch_budget(max_num_batched_tokens)
