"""Secret files (issue 15 item 8): exclusive no-follow temp files, fsync, mode checks, no
silent overwrite of a mesh's token."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnode.cli import app
from meshnode.cli import commands as _commands  # noqa: F401  (registers the commands)
from meshnode.net.address import Address
from meshnode.net.identity import (
    JoinToken,
    NodeIdentity,
    load_or_create_node_key,
    write_token_file,
)
from meshnode.net.secret_files import SecretFileError, check_private, private_dir, write_private
from meshnode.node.config import NodeConfig
from meshnode.node.process import RunningNode, write_node_file


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_private_durable_and_no_temp_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(stat.S_IFMT(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = tmp_path / "sub" / "secret"
    write_private(path, b"s3cret", overwrite=False)
    assert path.read_bytes() == b"s3cret"
    assert _mode(path) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret"]
    assert synced == [stat.S_IFREG, stat.S_IFDIR]  # the file, then its directory


def test_a_link_planted_at_the_temp_name_cannot_redirect_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    monkeypatch.setattr(secrets, "token_hex", lambda n: "fixed")
    (tmp_path / ".token.fixed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_private(tmp_path / "token", b"secret", overwrite=True)
    assert victim.read_bytes() == b"untouched"
    assert not (tmp_path / "token").exists()


def test_an_existing_secret_is_kept_unless_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write_private(path, b"first", overwrite=False)
    with pytest.raises(SecretFileError, match="already exists"):
        write_private(path, b"second", overwrite=False)
    assert path.read_bytes() == b"first"
    write_private(path, b"second", overwrite=True)
    assert path.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


def test_too_open_modes_are_refused_or_fixed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x")
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match=r"mode 0644.*chmod 600"):
        check_private(path, fix=False)
    with caplog.at_level(logging.WARNING):
        check_private(path, fix=True)
    assert _mode(path) == 0o600
    assert "had mode 0644" in caplog.text


def test_an_exposed_node_key_is_tightened_on_load(tmp_path: Path) -> None:
    key = load_or_create_node_key(tmp_path)
    (tmp_path / "node.key").chmod(0o640)
    again = load_or_create_node_key(tmp_path)
    assert _mode(tmp_path / "node.key") == 0o600
    assert again.private_numbers() == key.private_numbers()


def test_an_exposed_own_token_is_tightened_and_a_named_one_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = JoinToken.generate("m")
    config = NodeConfig(state_dir=tmp_path)
    write_token_file(config.own_token_file, token)
    config.own_token_file.chmod(0o644)
    assert config.resolve_token() == str(token)
    assert _mode(config.own_token_file) == 0o600
    named = tmp_path / "mounted-token"
    named.write_text(str(token))
    named.chmod(0o444)  # a read-only mount the node cannot tighten: it warns, and runs
    with caplog.at_level(logging.WARNING):
        assert NodeConfig(state_dir=tmp_path, token_file=named).resolve_token() == str(token)
    assert "others can read this join token" in caplog.text


def test_init_refuses_to_overwrite_a_token_file_without_force(tmp_path: Path) -> None:
    path = tmp_path / "mesh.token"
    first = CliRunner().invoke(app, ["init", "--name", "a", "--token-file", str(path)])
    assert first.exit_code == 0, first.output
    original = path.read_text()
    again = CliRunner().invoke(app, ["init", "--name", "b", "--token-file", str(path)])
    assert again.exit_code == 2
    assert "already exists" in again.output
    assert "--force" in again.output
    assert path.read_text() == original  # the mesh's only secret is intact
    forced = CliRunner().invoke(app, ["init", "--name", "b", "--token-file", str(path), "--force"])
    assert forced.exit_code == 0, forced.output
    assert path.read_text() != original
    assert _mode(path) == 0o600


# -- issue 36, item 13: the state dir and links planted in it -----------------------------


def test_a_state_dir_others_can_change_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable and not sticky: anyone may swap its entries
    with pytest.raises(SecretFileError, match="another user can change"):
        private_dir(shared / "mesh" / "worker")
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o775)
    with pytest.raises(SecretFileError, match="writable by no one else"):
        private_dir(loose)


def test_the_documented_example_under_a_sticky_tmp_still_works(tmp_path: Path) -> None:
    """The README's ``--state-dir /tmp/mesh/worker``: /tmp is world-writable but sticky,
    and the folders meshnode creates in it are 0700."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    state = private_dir(tmp / "mesh" / "worker")
    assert state == tmp / "mesh" / "worker"
    assert _mode(tmp / "mesh") == _mode(state) == 0o700
    assert private_dir(state) == state  # and again, once it exists


def test_a_link_planted_at_a_state_file_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victims-file"
    victim.write_bytes(b"untouched")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    for name in ("node.crt", "mesh-ca.crt", "node.json"):
        (state / name).symlink_to(victim)
    NodeIdentity.provision(JoinToken.generate("home"), state)
    write_node_file(state, RunningNode("n", 1, Address("127.0.0.1", 1), Address("127.0.0.1", 2)))
    assert victim.read_bytes() == b"untouched"
    assert not any((state / name).is_symlink() for name in ("node.crt", "mesh-ca.crt", "node.json"))


def test_a_node_key_link_is_refused_and_its_target_keeps_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "someones.key"
    load_or_create_node_key(tmp_path / "elsewhere")
    target.write_bytes((tmp_path / "elsewhere" / "node.key").read_bytes())
    target.chmod(0o644)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "node.key").symlink_to(target)
    with pytest.raises(SecretFileError, match="symbolic link"):
        load_or_create_node_key(state)
    assert _mode(target) == 0o644


def test_a_key_owned_by_another_user_is_refused_not_tightened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_or_create_node_key(tmp_path)
    (tmp_path / "node.key").chmod(0o640)
    mine = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: mine + 1)  # as if another user ran the node
    with pytest.raises(SecretFileError, match=f"belongs to uid {mine}"):
        load_or_create_node_key(tmp_path)
    assert _mode(tmp_path / "node.key") == 0o640
