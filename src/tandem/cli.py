"""The `tandem` command line. Each command is added by the module that implements it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="tandem",
    help="Micro-batch overlap runtime for Mixture-of-Experts inference.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from tandem import __version__

        typer.echo(f"tandem {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Micro-batch overlap runtime for Mixture-of-Experts inference."""
