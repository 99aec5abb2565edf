"""Files that hold secrets (the node key, join tokens): written atomically, private, durable.

Writing: the bytes go to a fresh temporary file beside the target, created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (a link planted at its name cannot redirect
the write, and nobody can read it between creation and a chmod, since there is none),
flushed to disk with ``fsync``, then moved into place — ``rename`` to replace, ``link`` to
refuse an existing target atomically — and the directory is ``fsync``-ed so that the
rename survives a power cut. A crash leaves either the old file or the new one.

Reading: :func:`check_private` refuses a secret file that others can read or write, as ssh
does for its keys; files meshnode made itself are tightened back to 0600 instead
(``fix=True``), with a warning.

Errors: :class:`SecretFileError` (a :class:`~meshnode.errors.ConfigError`: the CLI prints it
and exits 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from meshnode.errors import ConfigError

log = logging.getLogger(__name__)

PRIVATE_MODE: Final = 0o600
# Permission bits that let anyone but the owner read, write or execute the file.
_EXPOSED_BITS: Final = 0o077
_TMP_FLAGS: Final = (
    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
)


class SecretFileError(ConfigError):
    """A secret file that exists where it must not, or that others can read."""


def write_private(path: Path, data: bytes, *, overwrite: bool) -> None:
    """Write ``data`` to ``path`` (mode 0600, durable); see the module docstring.

    Raises :class:`SecretFileError` when ``path`` exists and not ``overwrite``; ``OSError``
    when the directory cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, _TMP_FLAGS, PRIVATE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _install(tmp, path, overwrite=overwrite)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)


def _install(tmp: Path, path: Path, *, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if path exists, whatever it is: no check-then-write race
    except FileExistsError:
        raise SecretFileError(f"{path} already exists; not overwriting it") from None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_private(path: Path, *, fix: bool) -> None:
    """Refuse ``path`` if group or others have any access to it; with ``fix``, chmod 0600.

    ``fix`` is for files meshnode created itself (the node key, the state dir's token),
    where a wider mode is a later accident; it needs the file to be ours. Raises
    :class:`SecretFileError` with the mode and the command that fixes it.
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & _EXPOSED_BITS:
        return
    if fix:
        try:
            os.chmod(path, PRIVATE_MODE)
        except PermissionError:
            pass
        else:
            log.warning("%s had mode %04o (open to others); set it to 0600", path, mode)
            return
    raise SecretFileError(
        f"{path} has mode {mode:04o}: others can access this secret; "
        f"run `chmod 600 {path}` (and consider the secret exposed)"
    )


def warn_if_exposed(path: Path) -> None:
    """Log a warning if others can access ``path`` (a secret meshnode may not chmod).

    For a token file the user names: a read-only mount (a container secret) cannot be
    tightened by the node, and refusing it would stop the node, so this only warns.
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _EXPOSED_BITS:
        log.warning("%s has mode %04o: others can read this join token", path, mode)
