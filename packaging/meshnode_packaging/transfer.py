"""What the whole-file fetcher (:mod:`~meshnode_packaging.fetch`) and the range fetcher
(:mod:`~meshnode_packaging.ranged`) share: progress counting across threads, and what an
HTTP status means for a download (fail, retry, or go on)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx

from meshnode_packaging.errors import FetchError, NotFound, Unauthorized

ProgressFn = Callable[[int, int], None]


class Retry(Exception):
    """A response worth another attempt (5xx, 429, a body that ended early, a stale partial
    file); counts as a failed attempt."""


class Progress:
    """Bytes done of ``total``, added from several download threads; ``fn(done, total)`` is
    called after every addition."""

    def __init__(self, total: int, fn: ProgressFn | None) -> None:
        self.done, self.total, self._fn = 0, total, fn
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if n == 0:
            return
        with self._lock:
            self.done += n
            if self._fn is not None:
                self._fn(self.done, self.total)


def check_status(r: httpx.Response, url: str, *, ranged: bool = False) -> None:
    """Raises what ``r``'s status means: no access, no such file, :class:`Retry`, or another
    failure; with ``ranged``, anything but 206 Partial Content is a failure."""
    code = r.status_code
    if code in (401, 403):
        raise Unauthorized(f"HTTP {code}: set HF_TOKEN to a token with access", url=url)
    if code == 404:
        raise NotFound("HTTP 404: no such repository, revision or file", url=url)
    if code == 429 or code >= 500:
        raise Retry(f"HTTP {code}")
    if ranged and code != 206:
        raise FetchError(f"HTTP {code}: expected 206 Partial Content for a Range request", url=url)
    if code >= 400:
        raise FetchError(f"HTTP {code}", url=url)
