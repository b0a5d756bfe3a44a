"""How a configuration field is also a command-line option.

`option(...)` declares a dataclass field whose metadata carries its help text and, where it is
not `--field-name`, its flag; `tandem.cli_options` reads the fields back (`cli_fields`) and
generates one typer option per field. `parse_int_tuple` is the one parser a flag shares with
its field (`--pp-layer-partition 10,14`).
"""

from __future__ import annotations

from dataclasses import MISSING, field, fields
from typing import Any, Callable


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    cli_type: type | None = None,
    parse: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
    envvar: str | None = None,
    hidden: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A configuration field that is also a command-line option.

    `flag`: the option's declaration when it is not `--field-name` (e.g. "--trace", or
    "--overlap-schedule/--disable-overlap-schedule" for a switch); `cli_type` + `parse`: the
    type the command line takes and how it becomes the field's value (e.g. "10,14" -> (10, 14))."""
    metadata = {
        "help": help, "flag": flag, "cli_type": cli_type, "parse": parse, "metavar": metavar, "envvar": envvar,
        "hidden": hidden,
    }
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"cli": metadata})
    return field(default=default, metadata={"cli": metadata})


def cli_fields(section: type) -> list:
    """The fields of a config dataclass that are command-line options, in declaration order."""
    return [f for f in fields(section) if "cli" in f.metadata]


def parse_int_tuple(text: str | tuple | list | None) -> tuple[int, ...] | None:
    """'10,14' -> (10, 14); a tuple or list passes through."""
    if text is None or isinstance(text, (tuple, list)):
        return None if text is None else tuple(int(v) for v in text)
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return values
