"""A loopback HTTP server with the Hugging Face ``/{repo}/resolve/{revision}/{path}`` layout.

For tests and benchmarks of the materializer (and of anything that fetches packages): it
serves local folders as repositories, honours ``Range``, counts requests and bytes, and can be
told to fail a file in the ways real servers do — 404, 401, a slow body, or dying in the
middle of one. It also answers the part of the hub's API that ``huggingface_hub`` calls:
``GET /api/models/{repo}/revision/{rev}`` (with ``blobs=true``: sizes, git blob ids, LFS
sha256) and ``HEAD`` on a file (``X-Repo-Commit``, ``ETag``/``X-Linked-Etag``,
``X-Linked-Size``). Each (repo, revision) gets a fixed commit sha, served as a revision too.
It uses only the standard library, so it runs wherever ``meshnode_packaging`` does.

    with LocalHub() as hub:
        hub.add_repo("org/model", folder)          # revision "main"
        os.environ["HF_ENDPOINT"] = hub.endpoint
        ...
        hub.requests                                # [Request(path, range_start, bytes_sent)]
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/?]+))?(?:\?.*)?$")
# Files this large (or with these suffixes) are LFS files on the hub: sha256 etag, size header.
_LFS_MIN_BYTES = 10 << 20
_LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
_SLOW_WRITES_PER_S = 20
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Request:
    """One served GET: the file path inside the repo, the Range start, the body bytes sent."""

    path: str
    status: int
    range_start: int
    bytes_sent: int
    authorization: str | None = None
    method: str = "GET"
    ended_s: float = 0.0  # time.monotonic() when the response ended


@dataclass(frozen=True)
class Fault:
    """What to do instead of serving a file normally: an HTTP status, die after N bytes, or
    send the body at most ``bytes_per_s`` fast."""

    status: int | None = None
    die_after_bytes: int | None = None
    bytes_per_s: int | None = None


@dataclass
class _State:
    repos: dict[tuple[str, str], Path] = field(default_factory=dict)
    commits: dict[tuple[str, str], str] = field(default_factory=dict)
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    bodies_started: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def _record(self, path: str, status: int, start: int, sent: int) -> None:
        with self.server.state.lock:
            auth = self.headers.get("Authorization")
            self.server.state.requests.append(
                Request(path, status, start, sent, auth, self.command, time.monotonic())
            )

    def _status_only(self, path: str, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self._record(path, status, 0, 0)

    def _next_fault(self, path: str) -> Fault | None:
        with self.server.state.lock:
            queue = self.server.state.faults.get(path)
            return queue.pop(0) if queue else None

    def _repo(self, repo: str, rev: str | None) -> tuple[Path, str] | None:
        key = (repo, rev or "main")
        state = self.server.state
        folder = state.repos.get(key)
        return None if folder is None else (folder, state.commits[key])

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, *, head: bool) -> None:
        url = unquote(self.path)
        if (api := _API.match(url)) and not head:
            return self._api(api["repo"], api["rev"])
        m = _RESOLVE.match(url)
        found = m and self._repo(m["repo"], m["rev"])
        if m is None or not found:
            return self._status_only(self.path, 404)
        folder, commit = found
        path = m["path"]
        fault = None if head else self._next_fault(path)
        if fault is not None and fault.status is not None:
            return self._status_only(path, fault.status)
        file = (folder / path).resolve()
        if folder.resolve() not in file.parents or not file.is_file():
            return self._status_only(path, 404)
        self._send_file(path, file, commit, fault, head=head)

    def _api(self, repo: str, rev: str | None) -> None:
        found = self._repo(repo, rev)
        if not found:
            return self._status_only(self.path, 404)
        folder, commit = found
        siblings = [_sibling(folder, f) for f in sorted(folder.rglob("*")) if f.is_file()]
        body = json.dumps({"id": repo, "sha": commit, "siblings": siblings}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self._record(self.path, 200, 0, len(body))

    def _send_file(
        self, path: str, file: Path, commit: str, fault: Fault | None, *, head: bool
    ) -> None:
        size = file.stat().st_size
        start, end = 0, size
        r = _RANGE.match(self.headers.get("Range", ""))
        if r:
            start, end = int(r[1]), (int(r[2]) + 1 if r[2] else size)
            if start >= size:
                return self._status_only(path, 416)
            end = min(end, size)
        self.send_response(206 if r else 200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", commit)
        lfs, etag = _etag(file)
        self.send_header("ETag", f'"{etag}"')
        if lfs:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        if r:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not head:
            with self.server.state.lock:
                self.server.state.bodies_started.append(path)
        sent = 0 if head else self._copy(file, start, end, fault)
        self._record(path, 206 if r else 200, start, sent)
        if fault is not None and fault.die_after_bytes is not None:
            self.close_connection = True

    def _copy(self, file: Path, start: int, end: int, fault: Fault | None) -> int:
        die_after = None if fault is None else fault.die_after_bytes
        rate = None if fault is None else fault.bytes_per_s
        limit = end - start if die_after is None else min(end - start, die_after)
        # A slow body still arrives in small pieces often, as packets over a slow link do.
        step = _CHUNK_BYTES if rate is None else max(1, rate // _SLOW_WRITES_PER_S)
        sent = 0
        with file.open("rb") as f:
            f.seek(start)
            while sent < limit:
                chunk = f.read(min(step, limit - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except OSError:  # the client went away; nothing left to serve
                    self.close_connection = True
                    break
                sent += len(chunk)
                if rate is not None:
                    time.sleep(len(chunk) / rate)
        return sent


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _is_lfs(file: Path) -> bool:
    return file.suffix in _LFS_SUFFIXES or file.stat().st_size >= _LFS_MIN_BYTES


_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def _etag(file: Path) -> tuple[bool, str]:
    """(is LFS, etag): the sha256 for LFS files, the git blob sha1 for the others (as the hub)."""
    st = file.stat()
    key = (str(file), st.st_size, st.st_mtime_ns)
    lfs = _is_lfs(file)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return lfs, _DIGESTS[key]
    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest
    return lfs, digest


def _sibling(folder: Path, file: Path) -> dict[str, Any]:
    size = file.stat().st_size
    lfs, etag = _etag(file)
    entry: dict[str, Any] = {"rfilename": file.relative_to(folder).as_posix(), "size": size}
    if lfs:
        entry["lfs"] = {"sha256": etag, "size": size, "pointerSize": 134}
    else:
        entry["blobId"] = etag
    return entry


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class LocalHub:
    """A threaded loopback server of local folders in the Hugging Face resolve layout."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._server = _Server((host, 0), _Handler)
        self._server.state = _State()
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: the value for ``HF_ENDPOINT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def requests(self) -> list[Request]:
        """A copy of the requests served so far."""
        with self._server.state.lock:
            return list(self._server.state.requests)

    @property
    def bodies_started(self) -> list[str]:
        """The paths of the file bodies started so far, in order (a request is in
        :attr:`requests` only once its body has ended: a slow one is under way before)."""
        with self._server.state.lock:
            return list(self._server.state.bodies_started)

    def clear_requests(self) -> None:
        """Forget the requests served so far."""
        with self._server.state.lock:
            self._server.state.requests.clear()

    def add_repo(
        self, repo: str, folder: Path, revision: str = "main", *, commit: str | None = None
    ) -> str:
        """Serve ``folder`` as ``repo`` at ``revision`` and at its commit sha; return the sha.

        Adding another folder under the same revision moves the branch, as a push would; the
        old commit stays served.
        """
        if commit is None:
            key = f"{repo}@{revision}:{folder}".encode()
            commit = hashlib.sha1(key, usedforsecurity=False).hexdigest()
        state = self._server.state
        for rev in (revision, commit):
            state.repos[(repo, rev)] = folder
            state.commits[(repo, rev)] = commit
        return commit

    def inject(self, path: str, *faults: Fault) -> None:
        """Make the next requests for ``path`` (a file inside any repo) fail, in this order."""
        with self._server.state.lock:
            self._server.state.faults.setdefault(path, []).extend(faults)

    def start(self) -> LocalHub:
        """Start serving in a daemon thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
