"""A loopback HTTP server with the Hugging Face ``/{repo}/resolve/{revision}/{path}`` layout.

For tests and benchmarks of the materializer (and of anything that fetches packages): it
serves local folders as repositories, honours ``Range``, counts requests and bytes, and can be
told to fail a file in the ways real servers do — 404, 401, or dying in the middle of a body.
It uses only the standard library, so it runs wherever ``meshnode_packaging`` does.

    with LocalHub() as hub:
        hub.add_repo("org/model", folder)          # revision "main"
        os.environ["HF_ENDPOINT"] = hub.endpoint
        ...
        hub.requests                                # [Request(path, range_start, bytes_sent)]
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
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


@dataclass(frozen=True)
class Fault:
    """What to do instead of serving a file normally: an HTTP status, or die after N bytes."""

    status: int | None = None
    die_after_bytes: int | None = None


@dataclass
class _State:
    repos: dict[tuple[str, str], Path] = field(default_factory=dict)
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def _record(self, path: str, status: int, start: int, sent: int) -> None:
        with self.server.state.lock:
            auth = self.headers.get("Authorization")
            self.server.state.requests.append(Request(path, status, start, sent, auth))

    def _status_only(self, path: str, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self._record(path, status, 0, 0)

    def _next_fault(self, path: str) -> Fault | None:
        with self.server.state.lock:
            queue = self.server.state.faults.get(path)
            return queue.pop(0) if queue else None

    def do_GET(self) -> None:
        m = _RESOLVE.match(unquote(self.path))
        folder = m and self.server.state.repos.get((m["repo"], m["rev"]))
        if m is None or folder is None:
            return self._status_only(self.path, 404)
        path = m["path"]
        fault = self._next_fault(path)
        if fault is not None and fault.status is not None:
            return self._status_only(path, fault.status)
        file = (folder / path).resolve()
        if folder.resolve() not in file.parents or not file.is_file():
            return self._status_only(path, 404)
        self._send_file(path, file, None if fault is None else fault.die_after_bytes)

    def _send_file(self, path: str, file: Path, die_after: int | None) -> None:
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
        if r:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        sent = self._copy(file, start, end, die_after)
        self._record(path, 206 if r else 200, start, sent)
        if die_after is not None:
            self.close_connection = True

    def _copy(self, file: Path, start: int, end: int, die_after: int | None) -> int:
        limit = end - start if die_after is None else min(end - start, die_after)
        sent = 0
        with file.open("rb") as f:
            f.seek(start)
            while sent < limit:
                chunk = f.read(min(_CHUNK_BYTES, limit - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except OSError:  # the client went away; nothing left to serve
                    break
                sent += len(chunk)
        return sent


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

    def clear_requests(self) -> None:
        """Forget the requests served so far."""
        with self._server.state.lock:
            self._server.state.requests.clear()

    def add_repo(self, repo: str, folder: Path, revision: str = "main") -> None:
        """Serve ``folder`` as ``repo`` at ``revision``."""
        self._server.state.repos[(repo, revision)] = folder

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
