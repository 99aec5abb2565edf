"""The Hugging Face hub, through ``huggingface_hub``: endpoint, token, pins, listings, files.

Everything here reads the environment when it is called, never at import (``huggingface_hub``
reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` into module constants at *its* import, so we pass
them explicitly on every call):

- ``HF_ENDPOINT`` (default ``https://huggingface.co``) is the hub;
- ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub`` is the cache that
  every Hugging Face tool shares (whole small files go there through ``hf_hub_download``);
- ``HF_TOKEN`` or the saved login (``huggingface_hub.get_token``) is sent **only to the hub's
  own host, and only over https** (:func:`token_for`): a plain-http endpoint or any other host
  never sees it;
- ``HF_HUB_OFFLINE=1`` answers from the caches only.

The host resolves a revision to a commit sha once (:func:`resolve_commit`); that pin travels in
``Prepare`` and every stage reads the repo at exactly that commit, checking that the hub agrees
(:func:`listing`). Revisions, file names and repo ids are validated before any of them becomes
a URL or a path (:func:`check_revision`, :func:`check_repo_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from meshnode_packaging.errors import (
    ChecksumMismatch,
    FetchError,
    NotFound,
    OfflineMissing,
    RefError,
    TransferError,
    Unauthorized,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
COMMIT = re.compile(r"[0-9a-f]{40}")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SEGMENT = re.compile(r"[A-Za-z0-9_.+-]+")
_TRUE = {"1", "true", "yes", "on"}
# A hub listing is JSON read into memory; a real one is tens of KB even for big repos.
MAX_LISTING_FILES = 100_000


def endpoint() -> str:
    """``HF_ENDPOINT`` read now, without a trailing slash."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: ``HF_HUB_CACHE``, ``HF_HOME/hub`` or the default."""
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "huggingface" / "hub"


def is_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for cache-only operation (read at call time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def token_for(url: str) -> str | None:
    """The hub token if ``url`` is on the hub's own host over https, else None.

    The token is the user's credential for the hub and nothing else: a package host, a CDN a
    redirect leads to, or a plain-http endpoint (a loopback test hub, a proxy) never gets it.
    """
    hub, target = urlsplit(endpoint()), urlsplit(url)
    if hub.scheme != "https" or target.scheme != "https" or target.netloc != hub.netloc:
        return None
    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()


def _api_token() -> str | bool:
    """What to hand ``huggingface_hub`` as ``token``: the token, or False (send none)."""
    return token_for(endpoint() + "/api") or False


def check_revision(revision: str) -> str:
    """``revision`` if it is a plain branch, tag or commit name; raise :class:`RefError`.

    No separators, no ``..``: a revision becomes a folder name in the cache and a URL segment.
    """
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise RefError(f"revision {revision!r}: use a branch, tag or commit (no '/', no '..')")
    return revision


def check_repo_path(path: str) -> str:
    """``path`` if it is a relative, ``/``-separated path of plain names; raise RefError."""
    parts = path.split("/")
    if not path or any(p in ("", ".", "..") or not _SEGMENT.fullmatch(p) for p in parts):
        raise RefError(f"file {path!r}: expected a relative path of plain names (no '..')")
    return path


def check_commit(pin: str) -> str:
    """``pin`` if it is a full hex commit sha; raise :class:`RefError`."""
    if not COMMIT.fullmatch(pin):
        raise RefError(f"commit pin {pin!r} is not a 40-digit hex sha")
    return pin


def _api() -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=_api_token())


def _mapped(exc: Exception, what: str) -> FetchError:
    """A ``huggingface_hub`` or transport error as ours: a status and a reason, no body."""
    from huggingface_hub.errors import HfHubHTTPError, RevisionResolutionError

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        code = exc.response.status_code
        if code in (401, 403):
            return Unauthorized(f"{what}: HTTP {code}: set HF_TOKEN to a token with access")
        if code == 404:
            return NotFound(f"{what}: HTTP 404: no such repository, revision or file")
        return FetchError(f"{what}: HTTP {code}")
    if isinstance(exc, RevisionResolutionError):
        return OfflineMissing(f"{what}: not resolvable offline and not in the hub cache")
    return TransferError(f"{what}: {type(exc).__name__}")


def resolve_commit(repo: str, revision: str) -> str:
    """The commit sha ``revision`` of ``repo`` names now (the host's pin).

    Offline, the ``refs/`` entry of the hub cache answers. Raises the ``FetchError`` tree.
    """
    from huggingface_hub.errors import HfHubHTTPError, RevisionResolutionError

    check_revision(revision)
    try:
        resolved = _api().resolve_revision(
            repo, revision=revision, cache_dir=hub_cache_dir(), local_files_only=is_offline()
        )
    except (HfHubHTTPError, RevisionResolutionError, httpx.HTTPError, OSError) as exc:
        raise _mapped(exc, f"hf://{repo}@{revision}") from exc
    return check_commit(str(resolved.resolved))


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo at a commit: size, and the hub's hash of it."""

    size: int
    sha256: str | None  # LFS files: the hub's sha256 of the content
    blob_id: str | None  # other files: the git blob sha1


@dataclass(frozen=True)
class Listing:
    """The files of ``repo`` at ``commit``, as the hub's API lists them."""

    repo: str
    commit: str
    files: dict[str, RepoFile]

    def to_json(self) -> str:
        files = {k: [f.size, f.sha256, f.blob_id] for k, f in self.files.items()}
        return json.dumps({"repo": self.repo, "commit": self.commit, "files": files})

    @classmethod
    def from_json(cls, text: str) -> Listing:
        data = json.loads(text)
        files = {k: RepoFile(int(v[0]), v[1], v[2]) for k, v in data["files"].items()}
        return cls(str(data["repo"]), str(data["commit"]), files)


def _listing_path(cache_dir: Path, repo: str, commit: str) -> Path:
    return cache_dir / ("models--" + repo.replace("/", "--")) / "listings" / f"{commit}.json"


def listing(repo: str, commit: str, cache_dir: Path) -> Listing:
    """The files of ``repo`` at ``commit`` (cached in ``cache_dir``, so offline works too).

    Checks that the hub reports the same commit (the stage's check of the host's pin). Raises
    the ``FetchError`` tree, or :class:`RefError` for a file name that could escape a folder.
    """
    check_commit(commit)
    path = _listing_path(cache_dir, repo, commit)
    if path.is_file():
        return Listing.from_json(path.read_text(encoding="utf-8"))
    if is_offline():
        raise OfflineMissing(f"HF_HUB_OFFLINE is set and hf://{repo}@{commit} was never listed")
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = _api().model_info(repo, revision=commit, files_metadata=True)
    except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
        raise _mapped(exc, f"hf://{repo}@{commit}") from exc
    if info.sha != commit:
        raise ChecksumMismatch(f"hf://{repo}: the hub answered commit {info.sha} for pin {commit}")
    siblings = info.siblings or []
    if len(siblings) > MAX_LISTING_FILES:
        raise FetchError(f"hf://{repo}: more than {MAX_LISTING_FILES} files")
    files = {}
    for s in siblings:
        rel = check_repo_path(s.rfilename)
        sha = s.lfs.sha256 if s.lfs is not None else None
        files[rel] = RepoFile(int(s.size or 0), sha, s.blob_id)
    result = Listing(repo, commit, files)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(result.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return result


def file_url(repo: str, commit: str, rel: str) -> str:
    """The resolve URL of ``rel`` at ``commit`` (``huggingface_hub.hf_hub_url``)."""
    from huggingface_hub import hf_hub_url

    return str(hf_hub_url(repo, check_repo_path(rel), revision=commit, endpoint=endpoint()))


def download_small(repo: str, commit: str, rel: str, entry: RepoFile) -> Path:
    """Whole file ``rel`` in the shared hub cache (``hf_hub_download``), checked by its hash.

    LFS files are checked against the hub's sha256, others against their git blob id.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(
            hf_hub_download(
                repo,
                check_repo_path(rel),
                revision=commit,
                cache_dir=hub_cache_dir(),
                endpoint=endpoint(),
                token=_api_token(),
                local_files_only=is_offline(),
            )
        )
    except LocalEntryNotFoundError as exc:
        raise OfflineMissing(f"HF_HUB_OFFLINE is set and {rel} is not in the hub cache") from exc
    except (HfHubHTTPError, httpx.HTTPError, OSError) as exc:
        raise _mapped(exc, f"hf://{repo}@{commit}/{rel}") from exc
    _check_whole(path, rel, entry)
    return path


def _check_whole(path: Path, rel: str, entry: RepoFile) -> None:
    data = path.read_bytes()
    if entry.sha256 is not None:
        ok = hashlib.sha256(data).hexdigest() == entry.sha256
    elif entry.blob_id is not None:
        git = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False)
        ok = git.hexdigest() == entry.blob_id
    else:
        ok = len(data) == entry.size
    if not ok:
        raise ChecksumMismatch(f"{rel}: the cached file does not match the hub's hash")
