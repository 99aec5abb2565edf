"""The command line's own surface: --version, help text with env variables and brackets."""

from __future__ import annotations

from importlib.metadata import version

from typer.testing import CliRunner

from meshnode.cli import app
from meshnode.cli import commands as _commands  # noqa: F401  (registers the commands)
from meshnode.node.config import SETTINGS


def test_version_prints_the_distribution_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"meshnode {version('meshnode')}"


def test_join_help_shows_refs_intact_and_every_environment_variable() -> None:
    result = CliRunner().invoke(app, ["join", "--help"], terminal_width=200)
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())  # undo the line wrapping
    assert "hf://org/repo[@rev]" in help_text
    for setting in SETTINGS:
        assert f"[env: {setting.env}]" in help_text, setting.env
    # A negative flag's variable is the positive setting: the help says which value disables.
    assert "--no-mdns Disable mDNS discovery (as MESHNODE_MDNS=0 does)." in help_text
