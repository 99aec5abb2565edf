"""The ``meshnode`` command line: each command builds a config and calls one ``run``.

Each command group lives in its own module and registers itself on ``app``. The top of the
layering: it imports every package, and ``meshnode.cli.join`` composes ``join`` (the
daemon, the host role and the API served through it).
"""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    name="meshnode",
    help="Run one large language model across the machines you already have.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help text: rich markup would eat literal brackets such as hf://org/repo[@rev].
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"meshnode {version('meshnode')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Run one large language model across the machines you already have."""


def main() -> None:
    """Entry point of the ``meshnode`` console script."""
    from meshnode.cli import commands  # noqa: F401  (registers the commands on ``app``)

    app()
