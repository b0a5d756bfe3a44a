"""Which MoE kernels a full CUDA graph can hold: a refusal at configuration and at wrapper
construction instead of a capture that fails (a host sync: "operation not permitted when
stream is capturing") or hangs (a CPU wait for peers that a replay never delivers)."""

from __future__ import annotations

from typing import Any

from tandem.modular_kernels.kernel import FusedMoEModularKernel

_WHY_NOT = {
    "deepep_high_throughput": "its dispatch waits on the CPU for the peers' token counts, which a replayed graph "
    "never delivers (the capture would hang, then time out)",
    "torch_a2a": "it reads the peers' token counts on the host (.tolist()) and picks rows with nonzero, "
    "host syncs a capture refuses",
    "torch": "the standard-format torch experts pick each expert's rows with nonzero, a host sync a capture refuses",
}
_USE_INSTEAD = (
    "use --graph-mode none, or capturable backends: --all2all-backend local, torch_a2a_ll or deepep_low_latency "
    "with --moe-backend triton or deep_gemm (torch is capturable only in the masked layout of torch_a2a_ll and "
    "deepep_low_latency)"
)


def _refuse(all2all: list[str], experts: list[str]) -> None:
    parts = [f"the {name} all2all backend: {_WHY_NOT.get(name, 'it is not graph-capturable')}" for name in sorted(set(all2all))]
    parts += [
        f"the {name} moe backend in the standard layout: {_WHY_NOT.get(name, 'it is not graph-capturable')}"
        for name in sorted(set(experts))
    ]
    if parts:
        raise ValueError(f"--graph-mode full cannot capture {'; '.join(parts)}; {_USE_INSTEAD}")


def check_backend_graph_capturable(all2all_backend: str, moe_backend: str | None = None) -> None:
    """Refuse `graph_mode="full"` with this `--all2all-backend` / `--moe-backend` pair."""
    from tandem.modular_kernels.factory import ALL2ALL_BACKENDS, MOE_BACKENDS, _load

    if all2all_backend not in ALL2ALL_BACKENDS:
        return
    prepare = _load(ALL2ALL_BACKENDS[all2all_backend])
    refused_experts = []
    if moe_backend in MOE_BACKENDS and prepare.activation_format in MOE_BACKENDS[moe_backend]:
        experts_path = MOE_BACKENDS[moe_backend][prepare.activation_format]
        # Import only the torch experts (the others may need GPU libraries): they are the ones
        # whose capturability depends on the layout.
        if moe_backend == "torch" and not _load(experts_path).graph_capturable:
            refused_experts.append(moe_backend)
    _refuse([] if prepare.graph_capturable else [all2all_backend], refused_experts)


def check_graph_capturable(model: Any) -> None:
    """Refuse `graph_mode="full"` for a model with an MoE kernel (an attribute of one of
    its submodules) whose all2all or experts backend cannot be captured."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    kernels = [
        value for module in modules for value in vars(module).values() if isinstance(value, FusedMoEModularKernel)
    ]
    _refuse(
        [k.prepare_finalize.name for k in kernels if not k.prepare_finalize.graph_capturable],
        [k.experts.name for k in kernels if not getattr(k.experts, "graph_capturable", True)],
    )


def state_lost_by_a_failed_step(model: Any) -> list[str]:
    """The all2all backends of `model`'s MoE kernels whose cross-rank state a step that
    failed part-way leaves out of step (`survives_failed_step = False`): DeepEP's
    low-latency double buffer flips on the host at every call, so an aborted layer leaves
    this rank's parity out of step with its peers and with captured graphs."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    return sorted(
        {
            value.prepare_finalize.name
            for module in modules
            for value in vars(module).values()
            if isinstance(value, FusedMoEModularKernel) and not getattr(value.prepare_finalize, "survives_failed_step", True)
        }
    )
