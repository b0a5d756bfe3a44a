"""The command line's engine settings: a command's flags to an `EngineConfig`, with the
checks that must fail before any rank starts (a device this machine lacks, a pipeline
partition that cannot fit the model) and torchrun's say over the ranks.

Every engine setting is a field of tandem.config's dataclass tree; `config_command` (in
tandem.cli_options) turns the sections a command takes into its options (docs/configuration.md).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from tandem.cli_options import Flags

if TYPE_CHECKING:
    from tandem.config import EngineConfig


def build_config(flags: Flags, **overrides) -> "EngineConfig":
    """The EngineConfig for a command's flags; a bad value raises `typer.BadParameter`, a
    device this machine lacks exits with one error line."""
    check_device(flags["device"])
    parallel = {**flags.section_values("parallel"), **overrides.get("parallel", {})}
    if parallel.get("pipeline_parallel_size", 1) > 1:
        try:
            check_pipeline_partition(flags["model"], parallel["pipeline_parallel_size"], parallel.get("pp_layer_partition"))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return flags.engine_config(**overrides)


def check_device(device: str) -> None:
    """`--device cuda` without CUDA: one error line on stderr and exit code 2, no traceback."""
    from tandem.platform.device import DeviceUnavailableError, check_device_flag

    try:
        check_device_flag(device)
    except DeviceUnavailableError as exc:
        print(f"[tandem] error: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(code=2) from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def check_pipeline_partition(model: str, stages: int, partition) -> None:
    """A partition that cannot fit the model fails here, before any rank starts."""
    from tandem.config import parse_int_tuple
    from tandem.distributed import partition_layers
    from tandem.models.loader import num_hidden_layers

    try:
        layers = num_hidden_layers(model)
    except (OSError, KeyError):
        return  # a bad model directory gets its own error where it is loaded
    partition_layers(layers, stages, list(parse_int_tuple(partition)) if partition else None)


def torchrun_world() -> tuple[int, int] | None:
    from tandem.distributed.torchrun import torchrun_world

    return torchrun_world()


def torchrun_parallel(flags: Flags) -> dict:
    """Under torchrun the ranks are torchrun's: WORLD_SIZE / PP of them per stage."""
    world = torchrun_world()
    if world is None:
        return {}
    stages = max(flags["pipeline_parallel_size"], 1)
    if world[1] % stages:
        raise typer.BadParameter(f"torchrun's WORLD_SIZE {world[1]} is not a multiple of --pipeline-parallel-size {stages}")
    return {"data_parallel_size": world[1] // stages}


def one_model(positional: str | None, option: str | None) -> str:
    """MODEL or --model (vLLM's two spellings); both given must agree."""
    if positional is not None and option is not None and positional != option:
        raise typer.BadParameter(f"two models given: {positional!r} (argument) and {option!r} (--model); give one")
    from tandem.config import EngineConfig

    return positional or option or EngineConfig.model
