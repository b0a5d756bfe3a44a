"""Command-line options generated from the configuration dataclasses (`tandem.config`).

A setting is declared once, as a field with `option(...)` metadata; a command names the
config sections it takes and `config_command` adds one typer option per field, with the
field's type, default and help. The command receives the parsed values as a `Flags`, which
builds the `EngineConfig` (and `HttpOptions`) from them.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable

import typer

from tandem.config import (
    CacheConfig,
    EngineConfig,
    HttpOptions,
    OverlapConfig,
    ParallelConfig,
    SchedulerConfig,
    cli_fields,
)

#: Section name -> (dataclass, attribute of EngineConfig or None for a separate object).
SECTIONS: dict[str, tuple[type, str | None]] = {
    "engine": (EngineConfig, ""),
    "overlap": (OverlapConfig, "overlap"),
    "parallel": (ParallelConfig, "parallel"),
    "cache": (CacheConfig, "cache"),
    "scheduler": (SchedulerConfig, "scheduler"),
    "http": (HttpOptions, None),
}
#: Section -> its heading in `--help`.
PANELS = {
    "engine": "Device and step",
    "overlap": "Overlap: DBO / TBO",
    "parallel": "Parallelism, MoE backends, SBO",
    "cache": "KV cache",
    "scheduler": "Scheduler",
    "http": "HTTP server",
}
#: Every section an engine-running command takes.
ENGINE_SECTIONS = ("engine", "overlap", "parallel", "cache", "scheduler")


@dataclass(frozen=True)
class ConfigFlag:
    """One generated option: its parameter name, section and field."""

    param: str
    section: str
    field: Any
    annotation: Any

    @property
    def meta(self) -> dict:
        return self.field.metadata["cli"]

    @property
    def declaration(self) -> str:
        return self.meta["flag"] or "--" + self.field.name.replace("_", "-")

    @property
    def default(self) -> Any:
        f = self.field
        return f.default if f.default is not MISSING else f.default_factory()


def _param_name(f) -> str:
    flag = f.metadata["cli"]["flag"]
    if flag is None:
        return f.name
    return flag.split("/")[0].lstrip("-").replace("-", "_")


def config_flags(*sections: str, only: typing.Iterable[str] | None = None) -> list[ConfigFlag]:
    """The options of `sections`, in declaration order; `only`: just these parameter names."""
    wanted = None if only is None else set(only)
    out, seen = [], {}
    for section in sections:
        cls, _ = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        for f in cli_fields(cls):
            param = _param_name(f)
            if wanted is not None and param not in wanted:
                continue
            if param in seen:
                raise TypeError(f"option {param!r} is declared by both {seen[param]} and {section}")
            seen[param] = section
            annotation = f.metadata["cli"]["cli_type"] or hints[f.name]
            if f.metadata["cli"]["cli_type"] is not None and f.default is None:
                annotation = typing.Optional[annotation]
            out.append(ConfigFlag(param, section, f, annotation))
    if wanted is not None and wanted - seen.keys():
        raise TypeError(f"no config field for option(s) {sorted(wanted - seen.keys())}")
    return out


def _typer_parameter(flag: ConfigFlag, *, default: Any, help: str | None, argument: bool) -> inspect.Parameter:
    meta = flag.meta
    if argument:
        # Typer boxes arguments apart from options: a panel name of their own, never a second
        # box under the options' heading.
        info = typer.Argument(default, help=help or meta["help"], rich_help_panel="Model")
    else:
        declarations = [meta["flag"]] if meta["flag"] else []  # else typer's own (--x/--no-x for a switch)
        info = typer.Option(
            default, *declarations, help=help or meta["help"], metavar=meta["metavar"], envvar=meta["envvar"],
            hidden=meta["hidden"], show_default=default is not None, rich_help_panel=PANELS[flag.section],
        )
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=flag.annotation)


class Flags:
    """The values of a command's generated options, and the configuration they make."""

    def __init__(self, flags: list[ConfigFlag], values: dict[str, Any]):
        self._flags = {f.param: f for f in flags}
        self._values = values

    def __getitem__(self, param: str) -> Any:
        return self._values[param]

    def __contains__(self, param: str) -> bool:
        return param in self._values

    def replace(self, **values: Any) -> "Flags":
        """The same flags with some values changed (a command that resolves one itself)."""
        unknown = values.keys() - self._values.keys()
        if unknown:
            raise TypeError(f"no option(s) {sorted(unknown)}")
        return Flags(list(self._flags.values()), {**self._values, **values})

    def section_values(self, section: str) -> dict[str, Any]:
        """Field name -> value (parsed) for the options of one section."""
        out = {}
        for param, flag in self._flags.items():
            if flag.section != section:
                continue
            value = self._values[param]
            parse = flag.meta["parse"]
            if parse is not None and value is not None:
                try:
                    value = parse(value)
                except ValueError as exc:
                    raise typer.BadParameter(f"{flag.declaration}: {exc}") from None
            out[flag.field.name] = value
        return out

    def engine_config(self, **overrides: dict[str, Any]) -> EngineConfig:
        """The EngineConfig; `overrides[section]` replaces some of a section's values. A bad
        value raises `typer.BadParameter` naming the flag."""
        def values(section: str) -> dict[str, Any]:
            return {**self.section_values(section), **overrides.get(section, {})}

        try:
            overlap = OverlapConfig(**values("overlap"))
            return EngineConfig(
                **values("engine"),
                overlap=overlap.with_thresholds_file(overlap.thresholds_file),
                parallel=ParallelConfig(**values("parallel")),
                cache=CacheConfig(**values("cache")),
                scheduler=SchedulerConfig(**values("scheduler")),
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None

    def http_options(self) -> HttpOptions:
        try:
            return HttpOptions(**self.section_values("http"))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None


def config_command(
    *sections: str,
    only: typing.Iterable[str] | None = None,
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
    arguments: typing.Iterable[str] = (),
) -> Callable:
    """Give a typer command the options of `sections` (generated from the fields): the
    command's own parameters come first, then the generated ones, and the command gets them
    as its `flags: Flags` parameter. `defaults` / `helps` override a field's default or help
    for this command; `arguments` are taken positionally instead of as options."""
    flags = config_flags(*sections, only=only)
    defaults, helps, arguments = defaults or {}, helps or {}, set(arguments)

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn).parameters.values() if p.name != "flags"]
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        generated = [
            _typer_parameter(
                f, default=defaults.get(f.param, f.default), help=helps.get(f.param), argument=f.param in arguments
            )
            for f in flags
        ]
        # Positional arguments first, as typer lists them.
        params = [p for p in own if _is_argument(p)] + [p for p in generated if isinstance(p.default, typer.models.ArgumentInfo)]
        params += [p for p in own if not _is_argument(p)] + [p for p in generated if not isinstance(p.default, typer.models.ArgumentInfo)]
        names = {f.param for f in flags}

        @functools.wraps(fn)
        def command(**kwargs):
            values = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
            return fn(**kwargs, flags=Flags(flags, values))

        command.__signature__ = inspect.Signature([p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params])
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__
        return command

    return decorate


def _is_argument(p: inspect.Parameter) -> bool:
    return isinstance(p.default, typer.models.ArgumentInfo)


def markdown_table(sections: typing.Iterable[str] = (*ENGINE_SECTIONS, "http")) -> str:
    """The flags table of docs/configuration.md: flag, section.field, default, help."""
    rows = ["| flag | config field | default | what it does |", "|---|---|---|---|"]
    for flag in config_flags(*sections):
        if flag.meta["hidden"]:
            continue
        _, attr = SECTIONS[flag.section]
        where = "HttpOptions" if attr is None else ("EngineConfig" + (f".{attr}" if attr else ""))
        help_text = flag.meta["help"].replace("|", "\\|")
        rows.append(f"| `{flag.declaration}` | `{where}.{flag.field.name}` | `{flag.default!r}` | {help_text} |")
    return "\n".join(rows) + "\n"


_TABLE_START, _TABLE_END = "<!-- flags table: generated -->", "<!-- end of flags table -->"


def write_flags_table(path: str) -> bool:
    """Replace the flags table between the markers in `path`; True when it changed."""
    from pathlib import Path

    text = Path(path).read_text()
    start, end = text.index(_TABLE_START) + len(_TABLE_START), text.index(_TABLE_END)
    updated = text[:start] + "\n" + markdown_table() + text[end:]
    if updated != text:
        Path(path).write_text(updated)
    return updated != text


__all__ = [
    "ENGINE_SECTIONS", "SECTIONS", "ConfigFlag", "Flags", "config_command", "config_flags", "markdown_table",
    "write_flags_table",
]


if __name__ == "__main__":
    # python -m tandem.cli_options [--write docs/configuration.md]: print (or write) the flags table.
    import sys

    if sys.argv[1:2] == ["--write"]:
        print(("updated " if write_flags_table(sys.argv[2]) else "unchanged ") + sys.argv[2])
    else:
        print(markdown_table(), end="")

