"""Files that hold secrets (the node key, join tokens): written atomically, private, durable.

Writing: the bytes go to a fresh temporary file beside the target, created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (a link planted at its name cannot redirect
the write, and nobody can read it between creation and a chmod, since there is none),
flushed to disk with ``fsync``, then moved into place — ``rename`` to replace, ``link`` to
refuse an existing target atomically — and the directory is ``fsync``-ed so that the
rename survives a power cut. A crash leaves either the old file or the new one.

Reading: :func:`read_private` (and :func:`check_private`) open the file with
``O_NOFOLLOW`` and judge what was opened: a symbolic link, a file that is not ours, or one
that others can read or write is refused, as ssh does for its keys; files meshnode made
itself are tightened back to 0600 instead (``fix=True``, with ``fchmod`` on the open file,
so a planted link's target is never changed), with a warning.

The state dir: :func:`private_dir` creates it (and missing parents) with mode 0700 and
refuses one that another user could change, or that sits in a folder another user could
change (a sticky folder such as ``/tmp`` excepted, as ssh's ``safe_path`` does): a
stranger who owns ``/tmp/mesh`` could otherwise plant links the node writes through
(issue 36, item 13).

Errors: :class:`SecretFileError` (a :class:`~meshnode.errors.ConfigError`: the CLI prints it
and exits 2).
"""

from __future__ import annotations

import contextlib
import errno
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
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# Permission bits that let group or others create, delete or rename entries in a folder.
_OTHERS_WRITE: Final = 0o022


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
    """:func:`read_private` without the contents."""
    read_private(path, fix=fix)


def read_private(path: Path, *, fix: bool) -> bytes:
    """The contents of the secret file ``path``, refused unless it is private and ours.

    Refused: a symbolic link, anything but a regular file, a file owned by another user,
    and one that group or others can access, unless ``fix``: for files meshnode created
    itself (the node key, the state dir's token), where a wider mode is a later accident,
    the open file is set to 0600. Raises :class:`SecretFileError` naming the fix.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise SecretFileError(f"{path} is a symbolic link: a secret must be a file") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretFileError(
                f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                "a secret another user can replace is not used"
            )
        _check_mode(path, fd, stat.S_IMODE(st.st_mode), fix=fix)
        return f.read()


def _check_mode(path: Path, fd: int, mode: int, *, fix: bool) -> None:
    if not mode & _EXPOSED_BITS:
        return
    if fix:
        os.fchmod(fd, PRIVATE_MODE)  # the file is ours: this cannot be refused
        log.warning("%s had mode %04o (open to others); set it to 0600", path, mode)
        return
    raise SecretFileError(
        f"{path} has mode {mode:04o}: others can access this secret; "
        f"run `chmod 600 {path}` (and consider the secret exposed)"
    )


def private_dir(path: Path) -> Path:
    """``path``, created with mode 0700 where missing (parents too); see the module
    docstring. Raises :class:`SecretFileError` when another user could change it or a
    folder above it, ``OSError`` when it cannot be created."""
    path = path.absolute()
    for folder in reversed((path, *path.parents)):
        if not folder.exists():
            with contextlib.suppress(FileExistsError):  # made by a concurrent start
                folder.mkdir(mode=0o700)
    st = os.stat(path)
    if st.st_uid != os.geteuid() or st.st_mode & _OTHERS_WRITE:
        raise SecretFileError(
            f"state dir {path} has mode {stat.S_IMODE(st.st_mode):04o} and owner uid "
            f"{st.st_uid}: it must belong to this user ({os.geteuid()}) and be writable "
            f"by no one else; run `chmod 700 {path}` or choose another --state-dir"
        )
    for folder in path.parents:
        st = os.stat(folder)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, os.geteuid()) or (st.st_mode & _OTHERS_WRITE and not sticky):
            raise SecretFileError(
                f"state dir {path} is inside {folder} (mode {stat.S_IMODE(st.st_mode):04o}, "
                f"owner uid {st.st_uid}), which another user can change: use a folder of "
                "your own (e.g. a new subfolder of /tmp, which meshnode creates 0700)"
            )
    return path


def warn_if_exposed(path: Path) -> None:
    """Log a warning if others can access ``path`` (a secret meshnode may not chmod).

    For a token file the user names: a read-only mount (a container secret) cannot be
    tightened by the node, and refusing it would stop the node, so this only warns.
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _EXPOSED_BITS:
        log.warning("%s has mode %04o: others can read this join token", path, mode)
