"""The materializer: bring exactly one stage's files of a remote package into a local cache.

Theory of operation. The manifest is fetched first (or, offline, read from the cache); it
names every file with its size and sha256, and :meth:`Manifest.files_for` picks the files a
:class:`~meshnode_packaging.manifest.Part` needs. Each file is then ensured, several at a time:

1. Take the file lock of its blob, so that two processes wanting the same file do not both
   write it: the second waits, then finds it cached.
2. A cached blob is hashed again before it is used (a cache hit is verified like a download;
   disks and people corrupt files). A bad one is deleted and fetched again.
3. A download streams into ``blobs/<sha256>.incomplete`` while hashing. After a transport
   failure it resumes with ``Range: bytes=N-`` from what is already there (the prefix is
   re-hashed, not trusted from memory, so a resume after a crash is just as safe).
4. A finished download whose hash is wrong is deleted and fetched once more from zero; a
   second mismatch raises :class:`ChecksumMismatch`. A right one is renamed into place
   (atomic), and the snapshot path is (re)linked to it.

A partial or corrupt file is therefore never visible under ``snapshots/``. The cache is laid
out like the Hugging Face hub cache::

    <cache>/models--org--repo/blobs/<sha256>                  file contents, named by hash
    <cache>/models--org--repo/snapshots/<revision>/<path>     relative symlinks to blobs

``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` are read when :meth:`Materializer.fetch`
is called, never at import; the token goes only to the hub's own host over https
(:func:`meshnode_packaging.hub.token_for`). A failed file, or the caller's ``cancel`` event,
stops the other downloads at their next read. Errors are the
:class:`~meshnode_packaging.errors.FetchError` tree: :class:`NotFound` (404),
:class:`Unauthorized` (401/403), :class:`ChecksumMismatch`, :class:`TransferError`
(connection failures after every retry), :class:`DiskFull`, :class:`OfflineMissing` and
:class:`Cancelled`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import httpx

from meshnode_packaging.errors import (
    Cancelled,
    ChecksumMismatch,
    DiskFull,
    FetchError,
    OfflineMissing,
    TransferError,
)
from meshnode_packaging.hub import token_for
from meshnode_packaging.manifest import MANIFEST_NAME, Manifest, Part
from meshnode_packaging.reference import RemotePackage
from meshnode_packaging.transfer import Progress, ProgressFn, Retry, check_status
from meshnode_packaging.validate import manifest_problems, sha256_file

"""``progress(bytes_done, bytes_total)``; called from worker threads, one call at a time."""

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class FetchLimits:
    """Knobs of the materializer, with the units in their names."""

    # A handful of streams fill a link; more only make the files' disk writes interleave.
    max_parallel_files: int = 4
    # Transport failures per file before TransferError; each retry resumes by Range.
    max_attempts: int = 4
    retry_backoff_s: float = 0.2
    timeout_s: float = 60.0
    # How long to wait for another process that is fetching the same file.
    lock_timeout_s: float = 3600.0
    # Free space to leave on the cache's file system after the fetch.
    reserve_free_bytes: int = 0
    # The manifest is JSON read into memory; anything larger is not a manifest.
    max_manifest_bytes: int = 64 << 20


def default_cache_dir() -> Path:
    """``$MESHNODE_CACHE_DIR`` (the variable behind ``join --cache-dir``), else
    ``$XDG_CACHE_HOME/meshnode/hub`` (``~/.cache/meshnode/hub``)."""
    if env := os.environ.get("MESHNODE_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshnode" / "hub"


def is_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for cache-only operation (read at call time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


@dataclass(frozen=True)
class _Want:
    rel: str
    size: int
    sha256: str


def _auth(url: str) -> dict[str, str]:
    """The hub token for ``url``: only the hub's own host over https gets it (``hub.token_for``);
    httpx drops it again on a redirect to another host."""
    token = token_for(url)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _link(link: Path, blob: Path) -> None:
    """Point ``link`` at ``blob`` atomically (a relative symlink, as the HF cache does)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex}.tmp")
    try:
        os.symlink(os.path.relpath(blob, link.parent), tmp)
    except OSError:  # file systems without symlinks: a hard link is just as atomic
        os.link(blob, tmp)
    os.replace(tmp, link)


class Materializer:
    """Fetches parts of remote packages into ``cache_dir`` (see the module docstring)."""

    def __init__(
        self,
        cache_dir: Path | None = None,
        *,
        limits: FetchLimits | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.limits = limits or FetchLimits()
        self._cancel = cancel
        # Set when one file of the fetch failed: the other downloads stop at their next read.
        self._failed = threading.Event()

    def _cancelled(self) -> bool:
        return self._failed.is_set() or (self._cancel is not None and self._cancel.is_set())

    def snapshot_dir(self, ref: RemotePackage) -> Path:
        """The folder where ``ref``'s files appear: a (partial) package folder."""
        return self.cache_dir / ref.cache_name / "snapshots" / ref.revision

    def _blob(self, ref: RemotePackage, sha256: str) -> Path:
        return self.cache_dir / ref.cache_name / "blobs" / sha256

    def fetch(
        self,
        ref: RemotePackage,
        part: Part | None = None,
        *,
        progress: ProgressFn | None = None,
        manifest_sha256: str | None = None,
    ) -> Path:
        """Materialize ``part`` of ``ref`` (``None``: every file); return the snapshot folder.

        ``manifest_sha256``, when given (a ``Load`` carries it), pins the manifest. Raises the
        :class:`~meshnode_packaging.errors.FetchError` tree, or ``InvalidPackage`` for a bad
        manifest.
        """
        offline = is_offline()
        with self._client() as client:
            manifest = self._manifest(client, ref, offline, manifest_sha256)
            rels = list(manifest.files) if part is None else manifest.files_for(part)
            wants = [
                _Want(r, int(manifest.files[r]["size"]), manifest.files[r]["sha256"]) for r in rels
            ]
            self._check_space(ref, wants)
            prog = Progress(sum(w.size for w in wants), progress)
            self._run_all(client, ref, wants, offline, prog)
        return self.snapshot_dir(ref)

    def _client(self) -> httpx.Client:
        headers = {"User-Agent": "meshnode-packaging", "Accept-Encoding": "identity"}
        n = self.limits.max_parallel_files
        return httpx.Client(
            headers=headers,
            follow_redirects=True,  # the Hub redirects LFS files to its CDN
            timeout=self.limits.timeout_s,
            limits=httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1),
        )

    def _run_all(
        self,
        client: httpx.Client,
        ref: RemotePackage,
        wants: list[_Want],
        offline: bool,
        prog: Progress,
    ) -> None:
        self._failed.clear()
        with ThreadPoolExecutor(max_workers=self.limits.max_parallel_files) as pool:
            futures = [pool.submit(self._ensure, client, ref, w, offline, prog) for w in wants]
            wait(futures, return_when=FIRST_EXCEPTION)
            self._failed.set()  # downloads in flight stop at their next read
            for f in futures:
                f.cancel()  # and what has not started never starts
            wait(futures)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
        first = next((e for e in errors if not isinstance(e, Cancelled)), None)
        if first is not None or errors:
            raise first or errors[0]  # type: ignore[misc]

    # -- manifest ------------------------------------------------------------------------

    def _manifest(
        self, client: httpx.Client, ref: RemotePackage, offline: bool, pinned: str | None
    ) -> Manifest:
        path = self.snapshot_dir(ref) / MANIFEST_NAME
        if offline:
            if not path.is_file():
                raise OfflineMissing(f"HF_HUB_OFFLINE is set and {path} is not cached")
            data = path.read_bytes()
            if pinned is not None and hashlib.sha256(data).hexdigest() != pinned:
                raise ChecksumMismatch(f"cached {path} does not match the pinned sha256")
        else:
            data = self._get_manifest(client, ref.file_url(MANIFEST_NAME), pinned)
        manifest = Manifest.loads(data)
        problems = manifest_problems(manifest)
        if problems:
            from meshnode_packaging.errors import InvalidPackage

            raise InvalidPackage(problems)
        if not offline:
            self._install_manifest(ref, data, manifest)
        return manifest

    def _get_manifest(self, client: httpx.Client, url: str, pinned: str | None) -> bytes:
        for attempt in range(self.limits.max_attempts):
            try:
                data = self._get_small(client, url)
            except (httpx.TransportError, Retry) as exc:
                if attempt + 1 == self.limits.max_attempts:
                    raise TransferError(f"manifest fetch failed: {exc}", url=url) from exc
                time.sleep(self.limits.retry_backoff_s * 2**attempt)
                continue
            if pinned is None or hashlib.sha256(data).hexdigest() == pinned:
                return data
            if attempt >= 1:  # one refetch after a mismatch, as for any file
                break
        raise ChecksumMismatch("manifest does not match the pinned sha256", url=url)

    def _get_small(self, client: httpx.Client, url: str) -> bytes:
        with client.stream("GET", url, headers=_auth(url)) as r:
            check_status(r, url)
            body = bytearray()
            for chunk in r.iter_raw():
                body += chunk
                if len(body) > self.limits.max_manifest_bytes:
                    raise FetchError("manifest larger than max_manifest_bytes", url=url)
        return bytes(body)

    def _install_manifest(self, ref: RemotePackage, data: bytes, manifest: Manifest) -> None:
        snapshot = self.snapshot_dir(ref)
        blob = self._blob(ref, hashlib.sha256(data).hexdigest())
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.is_file():
            tmp = blob.with_name(f"{blob.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, blob)
        self._prune_stale_links(snapshot, manifest)
        _link(snapshot / MANIFEST_NAME, blob)

    @staticmethod
    def _prune_stale_links(snapshot: Path, manifest: Manifest) -> None:
        """Unlink snapshot files of an older manifest (a moved revision) that no longer match."""
        for rel, entry in manifest.files.items():
            link = snapshot / rel
            if link.is_symlink() and Path(os.readlink(link)).name != entry["sha256"]:
                link.unlink()

    # -- one file ------------------------------------------------------------------------

    def _check_space(self, ref: RemotePackage, wants: list[_Want]) -> None:
        blobs = self._blob(ref, "x").parent
        blobs.mkdir(parents=True, exist_ok=True)
        needed = sum(w.size for w in wants if not self._blob(ref, w.sha256).is_file())
        free = shutil.disk_usage(blobs).free
        if needed + self.limits.reserve_free_bytes > free:
            raise DiskFull(
                f"need {needed} bytes (+{self.limits.reserve_free_bytes} reserve) in {blobs}, "
                f"{free} free"
            )

    def _ensure(
        self, client: httpx.Client, ref: RemotePackage, w: _Want, offline: bool, prog: Progress
    ) -> None:
        if self._cancelled():
            raise Cancelled(f"{w.rel}: fetch cancelled")
        blob = self._blob(ref, w.sha256)
        lock = filelock.FileLock(f"{blob}.lock", timeout=self.limits.lock_timeout_s)
        try:
            with lock:
                if not self._cached_ok(blob, w):
                    if offline:
                        raise OfflineMissing(f"HF_HUB_OFFLINE is set and {w.rel} is not cached")
                    self._download_verified(client, ref.file_url(w.rel), blob, w, prog)
                else:
                    prog.add(w.size)
                _link(self.snapshot_dir(ref) / w.rel, blob)
        except filelock.Timeout as exc:
            raise TransferError(f"{w.rel}: another process held {lock.lock_file} too long") from exc

    @staticmethod
    def _cached_ok(blob: Path, w: _Want) -> bool:
        if not blob.is_file():
            return False
        if blob.stat().st_size == w.size and sha256_file(blob) == w.sha256:
            return True
        blob.unlink()  # corrupt: never used, fetched again
        return False

    def _download_verified(
        self, client: httpx.Client, url: str, blob: Path, w: _Want, prog: Progress
    ) -> None:
        tmp = blob.with_name(blob.name + ".incomplete")
        for _ in range(2):  # a mismatch earns one complete refetch, then it is an error
            digest = self._download(client, url, tmp, w, prog)
            if digest == w.sha256:
                os.replace(tmp, blob)
                return
            prog.add(-tmp.stat().st_size)
            tmp.unlink()
        raise ChecksumMismatch(f"{w.rel}: sha256 differs from the manifest twice", url=url)

    def _download(self, client: httpx.Client, url: str, tmp: Path, w: _Want, prog: Progress) -> str:
        counted = 0
        for failures in range(self.limits.max_attempts):
            have = tmp.stat().st_size if tmp.is_file() else 0
            if have > w.size:
                tmp.unlink()
                have = 0
            prog.add(have - counted)
            counted = have
            try:
                return self._stream(client, url, tmp, w, prog)
            except (httpx.TransportError, Retry) as exc:
                counted = tmp.stat().st_size if tmp.is_file() else 0
                if failures + 1 == self.limits.max_attempts:
                    raise TransferError(
                        f"{w.rel}: {exc!r} after {failures + 1} attempts", url=url
                    ) from exc
                time.sleep(self.limits.retry_backoff_s * 2**failures)
        raise AssertionError("unreachable")

    def _stream(self, client: httpx.Client, url: str, tmp: Path, w: _Want, prog: Progress) -> str:
        """Append the rest of the file to ``tmp``; return the sha256 of the whole of it."""
        have = tmp.stat().st_size if tmp.is_file() else 0
        h = hashlib.sha256()
        if have:
            h = _hash_prefix(tmp)
        if have == w.size:
            return h.hexdigest()
        headers = {"Range": f"bytes={have}-"} if have else {}
        with client.stream("GET", url, headers={**headers, **_auth(url)}) as r:
            if r.status_code == 416:
                tmp.unlink()  # our partial file disagrees with the server's: start over
                raise Retry("HTTP 416 on resume")
            check_status(r, url)
            if have and r.status_code != 206:  # Range ignored: the body is the whole file
                prog.add(-have)
                have, h = 0, hashlib.sha256()
            return self._write_body(r, tmp, have, h, w, prog)

    def _write_body(
        self, r: httpx.Response, tmp: Path, have: int, h: Any, w: _Want, prog: Progress
    ) -> str:
        try:
            with tmp.open("ab" if have else "wb") as f:
                # Unsized: write what the socket gave at once, so that bytes received before
                # a connection drops are on disk for the Range resume (a sized iterator
                # would hold up to a chunk in memory and lose it with the exception).
                for chunk in r.iter_raw():
                    if self._cancelled():
                        raise Cancelled(f"{w.rel}: fetch cancelled")
                    if have + len(chunk) > w.size:
                        return ""  # longer than the manifest says: wrong file, never a match
                    f.write(chunk)
                    h.update(chunk)
                    have += len(chunk)
                    prog.add(len(chunk))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFull(f"disk full while writing {tmp}") from exc
            raise
        if have != w.size:  # the body ended early without an error from the transport
            raise Retry(f"body ended at {have} of {w.size} bytes")
        return str(h.hexdigest())


def _hash_prefix(path: Path) -> Any:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h
