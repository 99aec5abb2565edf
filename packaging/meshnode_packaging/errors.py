"""The exceptions of ``meshnode_packaging``: one tree, rooted at :class:`PackageError`.

::

    PackageError                  anything this distribution raises on purpose
    ├── InvalidPackage            a package folder or manifest is malformed (``problems`` lists why)
    │   └── DamagedPackage            a local package folder whose files do not match its manifest
    ├── MissingPart               a tensor or file that this partial package has not materialized
    ├── RefError                  a model reference that names nothing we can open
    └── FetchError                the materializer could not bring a file into the cache
        ├── NotFound              HTTP 404: no such repo, revision or file
        ├── Unauthorized          HTTP 401/403: a token is missing or lacks access
        ├── ChecksumMismatch      bytes do not hash to the manifest's sha256, even after a retry
        ├── TransferError         the connection failed (reset, server died mid-file) after retries
        ├── DiskFull              not enough free space in the cache folder
        └── OfflineMissing        ``HF_HUB_OFFLINE`` is set and the file is not in the cache

Foreign exceptions (``httpx``, ``OSError``) are mapped to this tree once, where they happen, with
``raise ... from exc`` so that the original cause stays in the traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class PackageError(Exception):
    """Base class of every error that ``meshnode_packaging`` raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a package: the file (relative to the package root) and the field."""

    file: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: {self.field}" if self.field else self.file
        return f"{where}: {self.message}"


class InvalidPackage(PackageError):
    """A package folder or manifest is malformed; ``problems`` lists every finding."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid package ({len(problems)} problem(s)):\n{lines}")


class DamagedPackage(InvalidPackage):
    """A local package folder whose files are missing or differ from its manifest.

    Its message is one line: the folder, the first problem and how many more, and what to
    do (nothing can fetch a local folder again). ``problems`` lists them all.
    """

    def __init__(self, folder: Path, problems: list[Problem]) -> None:
        super().__init__(problems)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        #: What to do about it: a local folder has no origin to fetch its files from again.
        self.advice = (
            f"{folder} is a local folder, so nothing can fetch it again: copy it again or "
            "rebuild it with `meshnode package write`"
        )
        self.args = (f"package folder {folder} is damaged: {problems[0]}{more}; {self.advice}",)


class MissingPart(PackageError, KeyError):
    """A tensor or file that exists in the model but not in this (partial) package folder."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0]) if self.args else "missing part"


class RefError(PackageError):
    """A model reference that names no alias, file, folder, repository or URL we can open."""


class FetchError(PackageError):
    """The materializer could not bring a file into the cache."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        self.url = url
        super().__init__(message if url is None else f"{message} ({url})")


class NotFound(FetchError):
    """HTTP 404: the repository, revision or file does not exist."""


class Unauthorized(FetchError):
    """HTTP 401 or 403: the request needs a (different) ``HF_TOKEN``."""


class ChecksumMismatch(FetchError):
    """The downloaded bytes did not match the manifest's sha256, even after fetching them again."""


class TransferError(FetchError):
    """The transfer kept failing (connection reset, server died mid-file) after every retry."""


class DiskFull(FetchError):
    """The cache folder's file system has no room for the files to fetch."""


class OfflineMissing(FetchError):
    """``HF_HUB_OFFLINE`` is set and a needed file is not in the cache."""


class Cancelled(FetchError):
    """The fetch was cancelled: ``Stop``, or another file of the same fetch failed."""
