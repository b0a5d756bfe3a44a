"""Which MoE kernels a full CUDA graph can hold: a refusal at construction instead of a
capture that hangs."""

from __future__ import annotations

from typing import Any, Iterable

from tandem.modular_kernels.kernel import FusedMoEModularKernel


def _refuse(names: Iterable[str]) -> None:
    names = sorted(set(names))
    if names:
        raise ValueError(
            f"--graph-mode full cannot capture the {', '.join(names)} all2all backend: its dispatch waits on the "
            "CPU for the peers' token counts, which a replayed graph never delivers (the capture would hang, then "
            "time out); use --graph-mode none, or a graph-capturable backend such as deepep_low_latency"
        )


def check_backend_graph_capturable(all2all_backend: str) -> None:
    """Refuse `graph_mode="full"` with this `--all2all-backend`."""
    from tandem.modular_kernels.factory import ALL2ALL_BACKENDS, _load

    if all2all_backend in ALL2ALL_BACKENDS and not _load(ALL2ALL_BACKENDS[all2all_backend]).graph_capturable:
        _refuse([all2all_backend])


def check_graph_capturable(model: Any) -> None:
    """Refuse `graph_mode="full"` for a model with an MoE kernel (an attribute of one of
    its submodules) whose all2all backend cannot be captured."""
    modules = model.modules() if hasattr(model, "modules") else [model]
    _refuse(
        value.prepare_finalize.name
        for module in modules
        for value in vars(module).values()
        if isinstance(value, FusedMoEModularKernel) and not value.prepare_finalize.graph_capturable
    )
