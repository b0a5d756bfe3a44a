"""The layers of `src/tandem`, low to high: a module may import its own layer or a lower one.
The one list of them; `tests/test_layering.py` checks the import graph against it and
`benchmarks/config_flow.py` follows the configuration through it."""

from __future__ import annotations

#: Low to high. A module may import its own layer or a lower one.
LAYERS: tuple[str, ...] = (
    "platform",
    "ubatch",
    "contexts",
    "distributed",
    "modular_kernels",
    "config",
    # `tandem tune`'s default sweep and margin: the CLI's defaults and the simulated prior's sweep.
    "tune_sweep",
    "models",
    # One step of one rank (model runner, ubatch wrapper, sampler, KV cache).
    "worker",
    # The request loop (engine, scheduler, pipeline loop) over a worker.
    "engine",
    # The runner's public import path (re-exports UBatchWrapper, ModelRunner, FutureMap, Scheduler, Engine).
    "runner",
    "serving",
    "bench",
    # `tandem simulate`: an overlap mode's step on a cluster, from the runtime's own schedules.
    "simulate",
    # Typer options generated from the config tree's fields, for the command line only.
    "cli_options",
    # A command's flags to an EngineConfig, with the checks that fail before any rank starts.
    "cli_config",
    # `bench` and `tune`'s sweep settings, options and spec.
    "cli_bench",
    "cli",
    # The package's face: `tandem/__init__.py` re-exports the public API, `__main__` runs the CLI.
    "api",
)


def layer_of(module: str) -> str | None:
    """The layer of a `tandem.*` module name (None outside the package)."""
    parts = module.split(".")
    if parts[0] != "tandem":
        return None
    return "api" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


__all__ = ["LAYERS", "layer_of"]
