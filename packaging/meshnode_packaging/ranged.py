"""Byte ranges of remote files, fetched with HTTP ``Range`` into sparse local files.

Theory of operation. A stage of a model in an ordinary hub repo needs only some byte ranges of
each weight file: the header, and its own tensors. A :class:`PartialFile` is a local file of
the remote file's full size (sparse: ranges never written take no disk) plus a sidecar
``<name>.ranges.json`` listing the ranges known to be present. Readers memory-map it like the
whole file, and must only touch present ranges (the source over it checks, see
:mod:`meshnode_packaging.remote`).

:func:`fetch_ranges` splits what is missing into pieces of at most ``max_piece_bytes`` and
fetches several at once (``max_parallel``). A piece is recorded in the sidecar only after all
its bytes are written, so a crash loses at most the pieces in flight; a transport failure
resumes the piece from the byte it reached (``Range: bytes=N-M``). Every response is checked:
``206`` with a ``Content-Range`` naming exactly the bytes asked for and the file size the
listing gave, and ``X-Repo-Commit`` (when the hub sends one) equal to the pin.

A failed piece, or the caller's ``cancel`` event, stops every other transfer within one chunk
(one socket read; a silent connection is cut by the read timeout): the first failure is
raised once they have all returned.

Integrity: a whole file's sha256 is checked against the hub's when all of it is present
(:meth:`PartialFile.complete`); a range alone has no hash on the hub, so it rests on the
commit pin, TLS, and these header and size checks.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import filelock
import httpx

from meshnode_packaging.errors import (
    Cancelled,
    DiskFull,
    FetchError,
    TransferError,
)
from meshnode_packaging.hub import token_for
from meshnode_packaging.transfer import Progress, ProgressFn, Retry, check_status

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass(frozen=True)
class RangeLimits:
    """Knobs of the range fetcher, with units in their names."""

    # A handful of streams fill a link; more mostly add request overhead on the hub.
    max_parallel: int = 4
    # A piece is the unit of resume after a crash and of parallelism within one file.
    max_piece_bytes: int = 16 << 20
    # Ranges closer than this are fetched as one (a request costs about a round trip).
    merge_gap_bytes: int = 64 << 10
    max_attempts: int = 4
    retry_backoff_s: float = 0.2
    timeout_s: float = 60.0
    lock_timeout_s: float = 3600.0


@dataclass(frozen=True, order=True)
class ByteRange:
    """Bytes ``[start, end)`` of a file."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def merge(ranges: Iterable[ByteRange], gap: int = 0) -> list[ByteRange]:
    """``ranges`` sorted, with overlapping ones (or ones closer than ``gap``) joined."""
    out: list[ByteRange] = []
    for r in sorted(r for r in ranges if r.size > 0):
        if out and r.start <= out[-1].end + gap:
            out[-1] = ByteRange(out[-1].start, max(out[-1].end, r.end))
        else:
            out.append(r)
    return out


def subtract(want: list[ByteRange], have: list[ByteRange]) -> list[ByteRange]:
    """The parts of ``want`` not covered by ``have`` (both merged)."""
    out: list[ByteRange] = []
    for w in want:
        start = w.start
        for h in have:
            if h.end <= start or h.start >= w.end:
                continue
            if h.start > start:
                out.append(ByteRange(start, h.start))
            start = max(start, h.end)
        if start < w.end:
            out.append(ByteRange(start, w.end))
    return out


class PartialFile:
    """A sparse local copy of a remote file holding only some of its byte ranges."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self._sidecar = path.with_name(path.name + ".ranges.json")
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():  # was a link to a whole file elsewhere: never write through it
            path.unlink()
        self.verified: str | None = None  # the sha256 the whole file was checked against
        self.done = self._load()
        if not path.is_file() or path.stat().st_size != size:
            self.done, self.verified = [], None
            with path.open("wb") as f:
                f.truncate(size)  # sparse: unwritten ranges take no disk
            self._save()

    def _load(self) -> list[ByteRange]:
        try:
            data = json.loads(self._sidecar.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        if data.get("size") != self.size:
            return []
        self.verified = data.get("verified")
        return merge(ByteRange(int(s), int(e)) for s, e in data.get("done", []))

    def _save(self) -> None:
        tmp = self._sidecar.with_name(f"{self._sidecar.name}.{uuid.uuid4().hex}.tmp")
        done = [[r.start, r.end] for r in self.done]
        body = {"size": self.size, "done": done, "verified": self.verified}
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, self._sidecar)

    def file_lock(self, timeout_s: float) -> filelock.FileLock:
        """The lock that serialises processes fetching into this file."""
        return filelock.FileLock(f"{self.path}.lock", timeout=timeout_s)

    def missing(self, want: Iterable[ByteRange]) -> list[ByteRange]:
        """The parts of ``want`` not present yet."""
        with self._lock:
            return subtract(merge(want), self.done)

    def has(self, r: ByteRange) -> bool:
        """Whether every byte of ``r`` is present."""
        return not self.missing([r])

    def complete(self) -> bool:
        """Whether the whole file is present."""
        return self.has(ByteRange(0, self.size))

    def mark_done(self, r: ByteRange) -> None:
        with self._lock:
            self.done = merge([*self.done, r])
            self._save()

    def forget(self) -> None:
        """Drop every range (a whole-file hash mismatch: nothing here can be trusted)."""
        with self._lock:
            self.done, self.verified = [], None
            self._save()

    def mark_verified(self, sha256: str) -> None:
        """Record that the whole file matched ``sha256``, so it is not hashed again."""
        with self._lock:
            self.verified = sha256
            self._save()

    def read(self, r: ByteRange) -> bytes:
        with self.path.open("rb") as f:
            f.seek(r.start)
            return f.read(r.size)


class WholeFile(PartialFile):
    """A file already whole on disk (another tool put it in the shared hub cache): every
    range is present. Its hash check is remembered in ``marker`` beside our partial files,
    keyed by the file's size and modification time; the file itself is never written."""

    def __init__(self, path: Path, size: int, marker: Path) -> None:
        self.path, self.size = path, size
        self._sidecar = marker
        self._lock = threading.Lock()
        self.done = [ByteRange(0, size)]
        self.verified = None
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if data.get("stamp") == self._stamp():
            self.verified = data.get("verified")

    def _stamp(self) -> list[int]:
        st = self.path.stat()
        return [st.st_size, st.st_mtime_ns]

    def _save(self) -> None:
        self._sidecar.parent.mkdir(parents=True, exist_ok=True)
        body = {"stamp": self._stamp(), "verified": self.verified}
        self._sidecar.write_text(json.dumps(body), encoding="utf-8")

    def mark_done(self, r: ByteRange) -> None:
        raise AssertionError("a whole file is never fetched into")

    def forget(self) -> None:
        """Forget the hash check (the file is someone else's: it is left in place)."""
        with self._lock:
            self.verified = None
            self._save()


@dataclass(frozen=True)
class RangeJob:
    """Fetch ``piece`` of the file at ``url`` into ``target``."""

    url: str
    target: PartialFile
    piece: ByteRange


def pieces(missing: list[ByteRange], limits: RangeLimits) -> list[ByteRange]:
    """``missing`` (merged across small gaps) cut into pieces of at most ``max_piece_bytes``."""
    out = []
    for r in merge(missing, limits.merge_gap_bytes):
        for start in range(r.start, r.end, limits.max_piece_bytes):
            out.append(ByteRange(start, min(r.end, start + limits.max_piece_bytes)))
    return out


def _check_range(r: httpx.Response, url: str, want: ByteRange, size: int, pin: str) -> None:
    for resp in (*r.history, r):
        commit = resp.headers.get("X-Repo-Commit")
        if pin and commit is not None and commit != pin:
            raise FetchError(f"the hub served commit {commit}, not the pinned {pin}", url=url)
    m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
    if m is None or (int(m[1]), int(m[2]) + 1, int(m[3])) != (want.start, want.end, size):
        raise FetchError(
            f"Content-Range does not match bytes {want.start}-{want.end - 1}/{size}", url=url
        )


class RangeFetcher:
    """Runs :class:`RangeJob` s with bounded concurrency, retries and cancellation."""

    def __init__(
        self,
        *,
        limits: RangeLimits,
        pin: str = "",
        cancel: threading.Event | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.limits = limits
        self.pin = pin
        self._outer = cancel
        self._stop = threading.Event()
        self._progress_fn = progress

    def cancelled(self) -> bool:
        return self._stop.is_set() or (self._outer is not None and self._outer.is_set())

    def run(self, jobs: list[RangeJob]) -> None:
        """Fetch every job; raise the first failure after the others stopped."""
        prog = Progress(sum(j.piece.size for j in jobs), self._progress_fn)
        n = self.limits.max_parallel
        with (
            httpx.Client(
                follow_redirects=True,  # the hub redirects LFS files to its CDN
                timeout=self.limits.timeout_s,
                headers={"User-Agent": "meshnode-packaging", "Accept-Encoding": "identity"},
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            ) as client,
            ThreadPoolExecutor(max_workers=n) as pool,
        ):
            futures = [pool.submit(self._one, client, j, prog) for j in jobs]
            for f in futures:
                f.add_done_callback(self._stop_others_on_failure)
            wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        first = next((e for e in errors if not isinstance(e, Cancelled)), None)
        if first is not None:
            raise first
        if errors:
            raise errors[0]  # type: ignore[misc]

    def _stop_others_on_failure(self, f: Future[None]) -> None:
        if f.exception() is not None:
            self._stop.set()

    def _one(self, client: httpx.Client, job: RangeJob, prog: Progress) -> None:
        written = 0
        for attempt in range(self.limits.max_attempts):
            if self.cancelled():
                raise Cancelled("fetch cancelled", url=job.url)
            rest = ByteRange(job.piece.start + written, job.piece.end)
            try:
                written += self._stream(client, job, rest, prog)
                job.target.mark_done(job.piece)
                return
            except _PartialRead as exc:
                written += exc.written
                cause: Exception = exc.cause
            except (httpx.TransportError, Retry) as exc:
                cause = exc
            if attempt + 1 == self.limits.max_attempts:
                raise TransferError(
                    f"bytes {job.piece.start}-{job.piece.end - 1}: {type(cause).__name__} "
                    f"after {attempt + 1} attempts",
                    url=job.url,
                ) from cause
            time.sleep(self.limits.retry_backoff_s * 2**attempt)

    def _stream(self, client: httpx.Client, job: RangeJob, want: ByteRange, prog: Progress) -> int:
        headers = {"Range": f"bytes={want.start}-{want.end - 1}"}
        if token := token_for(job.url):
            headers["Authorization"] = f"Bearer {token}"  # httpx drops it on cross-host redirects
        written = 0
        try:
            with client.stream("GET", job.url, headers=headers) as r:
                check_status(r, job.url, ranged=True)
                _check_range(r, job.url, want, job.target.size, self.pin)
                written = self._write(r, job, want, prog)
        except (httpx.TransportError, Retry) as exc:
            if written:
                raise _PartialRead(written, exc) from exc
            raise
        return written

    def _write(self, r: httpx.Response, job: RangeJob, want: ByteRange, prog: Progress) -> int:
        written = 0
        try:
            with job.target.path.open("r+b") as f:
                f.seek(want.start)
                try:
                    for chunk in r.iter_raw():  # what the socket gave: a cancel is seen soon
                        if self.cancelled():
                            raise Cancelled("fetch cancelled", url=job.url)
                        if written + len(chunk) > want.size:
                            raise FetchError("the server sent more than the range", url=job.url)
                        f.write(chunk)
                        written += len(chunk)
                        prog.add(len(chunk))
                except (httpx.TransportError, Retry) as exc:
                    raise _PartialRead(written, exc) from exc
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFull(f"disk full while writing {job.target.path}") from exc
            raise
        if written != want.size:
            raise _PartialRead(written, Retry(f"body ended at {written} of {want.size} bytes"))
        return written


class _PartialRead(Exception):
    """A transfer that failed after writing ``written`` bytes (the retry resumes there)."""

    def __init__(self, written: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.written, self.cause = written, cause
