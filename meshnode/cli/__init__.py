"""The ``meshnode`` command line: each command builds a config and calls one ``run``.

Each command group lives in its own module and registers itself on ``app``.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="meshnode",
    help="Run one large language model across the machines you already have.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def main() -> None:
    """Entry point of the ``meshnode`` console script."""
    from meshnode.cli import commands  # noqa: F401  (registers the commands on ``app``)

    app()
