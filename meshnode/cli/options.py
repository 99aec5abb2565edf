"""Command-line options generated from the settings table: one typer option per row of
:data:`~meshnode.node.settings.SETTINGS` (its option, help and type), so that a knob is
declared once and ``meshnode join`` offers every setting the file and the environment do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from meshnode.node.settings import SETTINGS, CliKind, Setting

#: The Python type typer gives each kind of option (its metavar in ``--help``); ``None``
#: for a value not passed, ``False`` for a switch not passed.
_TYPES: dict[CliKind, Any] = {
    "str": str | None,
    "int": int | None,
    "float": float | None,
    "path": Path | None,
    "list": list[str] | None,
    "on": bool,
    "off": bool,
}


def parameter_name(setting: Setting) -> str:
    """The Python parameter that receives ``setting``'s option (``--max-memory``:
    ``max_memory``)."""
    return setting.option.removeprefix("--").replace("-", "_")


def _parameter(setting: Setting) -> inspect.Parameter:
    option = typer.Option(setting.option, help=setting.help_text)
    return inspect.Parameter(
        parameter_name(setting),
        inspect.Parameter.KEYWORD_ONLY,
        annotation=cast(Any, Annotated)[_TYPES[setting.cli], option],
        default=False if setting.cli in ("on", "off") else None,
    )


def flag_value(setting: Setting, received: Any) -> Any:
    """What :func:`~meshnode.node.config.load_config` takes for ``setting`` from what its
    option received: ``None`` when it was not passed (the lower layers decide), so a switch
    not given and an empty repeatable option are "not passed"."""
    if setting.cli == "on":
        return True if received else None
    if setting.cli == "off":
        return False if received else None
    if setting.cli == "list":
        return received or None
    return received


def with_setting_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with one option per setting before its own options.

    ``command`` takes a ``settings`` parameter: the flags as ``load_config`` takes them
    (``{setting name: value or None}``); its other parameters stay typer options of their
    own. Returns the function to register with typer.
    """
    own = inspect.signature(command, eval_str=True).parameters
    if "settings" not in own:
        raise TypeError(f"{command.__name__} takes no 'settings' parameter")
    generated = [_parameter(s) for s in SETTINGS]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.values()]
    params = generated + [p for p in rest if p.name != "settings"]
    clash = {p.name for p in generated} & {p.name for p in rest}
    if clash:
        raise TypeError(f"{command.__name__}'s parameters shadow settings: {sorted(clash)}")

    def run(**received: Any) -> None:
        settings = {s.name: flag_value(s, received.pop(parameter_name(s))) for s in SETTINGS}
        command(settings=settings, **received)

    run.__name__ = command.__name__
    run.__qualname__ = command.__qualname__
    run.__doc__ = command.__doc__
    run.__module__ = command.__module__
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run
