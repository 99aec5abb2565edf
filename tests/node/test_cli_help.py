"""The command line's own surface: --version, help text with env variables and brackets."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnode.cli import app
from meshnode.cli import commands as _commands  # noqa: F401  (registers the commands)
from meshnode.cli import join as join_module
from meshnode.node.config import Address, HeartbeatTimeouts, NodeConfig
from meshnode.node.settings import SETTINGS


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


def test_every_setting_has_one_option_and_help() -> None:
    """``join``'s options are generated from SETTINGS: each row needs its own option and
    a help text, or the generated option would clash or say nothing."""
    options = [s.option for s in SETTINGS]
    assert len(set(options)) == len(options)
    assert all(s.help.strip() for s in SETTINGS), [s.name for s in SETTINGS if not s.help]


@pytest.fixture
def joined(monkeypatch: pytest.MonkeyPatch) -> list[NodeConfig]:
    """The configs ``join`` would run (its ``run`` replaced), with no MESHNODE_* variable."""
    for name in [n for n in os.environ if n.startswith("MESHNODE_")]:
        monkeypatch.delenv(name)
    seen: list[NodeConfig] = []

    def run(config: NodeConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(join_module, "run", run)
    return seen


@pytest.mark.parametrize(
    ("args", "field", "expected"),
    [
        ([], "mdns", True),
        (["--no-mdns"], "mdns", False),
        ([], "allow_open_api", False),
        (["--allow-open-api"], "allow_open_api", True),
        (["--max-memory", "8GiB"], "max_memory_bytes", 8 * 2**30),
        (["--peer", "a:1", "--peer", "b:2"], "peers", (Address("a", 1), Address("b", 2))),
        ([], "peers", ()),
        (["--context", "64"], "context_size", 64),
        (["--pass-deadline-per-token", "0"], "pass_deadline_per_token_s", 0.0),
        (["--dtype", "float32"], "weights_dtype", "float32"),
        (["--local-model", "/m/a.gguf"], "local_models", (Path("/m/a.gguf"),)),
    ],
)
def test_join_options_reach_the_config(
    tmp_path: Path, joined: list[NodeConfig], args: list[str], field: str, expected: object
) -> None:
    """A generated option sets its setting (a switch or a repeatable option not passed
    leaves the default), parsed as the file and the environment are."""
    result = CliRunner().invoke(app, ["join", "--state-dir", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    assert getattr(joined[0], field) == expected
    assert joined[0].state_dir == tmp_path


def test_a_generated_option_with_a_bad_value_names_the_option(
    tmp_path: Path, joined: list[NodeConfig]
) -> None:
    result = CliRunner().invoke(app, ["join", "--state-dir", str(tmp_path), "--split", "0"])
    assert result.exit_code == 2
    assert "--split" in result.output
    assert joined == []


def test_heartbeat_options_reach_the_nested_record(
    tmp_path: Path, joined: list[NodeConfig]
) -> None:
    args = ["--heartbeat-interval", "0.5", "--suspect-after", "2", "--dead-after", "4"]
    args += ["--suspect-grace", "1.5"]
    result = CliRunner().invoke(app, ["join", "--state-dir", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    assert joined[0].heartbeat == HeartbeatTimeouts(0.5, 2.0, 4.0, suspect_grace_s=1.5)
