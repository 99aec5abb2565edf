"""The HTTP API's front door: one ASGI layer in front of every route of the node's app.

:func:`meshnode.serve.app.create_app` wraps the whole app in :class:`ApiGuard`, so every
route any module mounts (the OpenAI API, ``/v1/mesh/status``, ``/metrics``, the console)
passes the same three checks, in this order, before a handler runs:

1. **Host** (DNS rebinding). A browser page on ``evil.example`` whose name the attacker
   re-points at 127.0.0.1 reaches a loopback API as a same-origin page; only its ``Host``
   header gives it away. On a loopback bind only ``localhost``, ``127.0.0.1`` and ``[::1]``
   (any port) are answered. A non-loopback bind without a key (``--allow-open-api``) also
   answers IP literals, never names: a rebinding page always arrives under a name. A bind
   with a key checks no Host: the key is the defence, and LAN clients use any name.
2. **API key**. With ``--api-key`` every request needs ``Authorization: Bearer <key>``
   (or ``x-api-key: <key>``, as Anthropic's clients send it; compared in constant time),
   except the console page and its static assets (they hold no
   data; the page asks for the key and sends it with every data request), ``/health``
   (liveness probes carry no credentials) and CORS preflights (browsers never send
   credentials on an ``OPTIONS`` preflight).
3. **Body**. A body larger than :attr:`BodyLimits.max_bytes` is refused with 413 before it
   is read: at once from ``Content-Length``, or as soon as a chunked body passes the cap.
   A body that does not arrive within :attr:`BodyLimits.timeout_s` gets 408 (a slow-loris
   client cannot hold a connection open by trickling bytes). The handler then gets the
   whole body from memory.

Refusals are OpenAI-shaped (``{"error": {...}}``) so the official clients raise their
typed errors (401 → ``AuthenticationError``). Header and idle limits, which apply before a
request reaches any app, are hypercorn's (:mod:`meshnode.net.http`).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnode.errors import ConfigError
from meshnode.net.address import Address

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "ApiAccess",
    "ApiGuard",
    "BodyLimits",
    "HostRule",
    "check_api_exposure",
    "is_loopback",
]

#: Largest request body. The longest prompt a mesh serves (a 128 Ki-token context at about
#: 4 bytes of text per token) is ~512 KiB; JSON escaping and chat history at most double
#: it. 2 MiB leaves room for that, while the 11.6 MB body of issue 15 is refused unread.
DEFAULT_MAX_BODY_BYTES = 2 << 20
#: Seconds a request body may take to arrive in full: 2 MiB over a 1 Mbit/s link takes
#: ~17 s. Bounds how long a client trickling bytes (slow loris) holds a connection.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Bytes of a refused request's body read and dropped before the refusal is sent. A
#: client writes its whole body before it reads the answer; closing with unread bytes
#: makes the kernel send a reset that destroys the answer too (nginx's lingering close).
#: Beyond this much the connection is closed at once.
DRAIN_MAX_BYTES = 64 << 20
#: Seconds spent draining a refused body (a client that stops sending is not waited for).
DRAIN_TIMEOUT_S = 5.0
#: Paths served without the key: the console page and its assets (no data) and the
#: liveness probe. Every other path, present or future, needs the key.
PUBLIC_PATHS = frozenset({"/", "/health"})
PUBLIC_PREFIXES = ("/console/",)
#: ``Host`` names a loopback-bound API answers (with any port).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """How large a request body may be, and how long it may take to arrive."""

    max_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or not self.timeout_s > 0:
            raise ConfigError(f"invalid body limits: {self}")


class HostRule(enum.Enum):
    """Which ``Host`` headers are answered (see the module docstring)."""

    LOOPBACK = "loopback"  # loopback bind: localhost, 127.0.0.1, [::1]
    NO_NAMES = "no-names"  # open bind without a key: loopback names and IP literals
    ANY = "any"  # a key guards the API


@dataclass(frozen=True, slots=True)
class ApiAccess:
    """Who may use the API: the key (``None``: no key) and the ``Host`` rule."""

    api_key: str | None = field(default=None, repr=False)  # secret: never logged
    hosts: HostRule = HostRule.LOOPBACK

    @classmethod
    def for_bind(cls, address: Address, api_key: str | None) -> ApiAccess:
        """The access of an API bound to ``address``."""
        if is_loopback(address.host):
            return cls(api_key, HostRule.LOOPBACK)
        return cls(api_key, HostRule.NO_NAMES if api_key is None else HostRule.ANY)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request with this ``Host`` header (``None``: none sent) is answered."""
        if host is None or self.hosts is HostRule.ANY:
            return True  # no Host: not a browser, so not a rebinding page
        name = _host_name(host)
        if self.hosts is HostRule.LOOPBACK:
            return name in LOOPBACK_NAMES
        return name in LOOPBACK_NAMES or _is_ip(name)

    def key_ok(self, authorization: str | None, x_api_key: str | None = None) -> bool:
        """Whether a request carries the key (always, without one): as
        ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>``
        (Anthropic's)."""
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and _same(token.strip(), self.api_key):
            return True
        return x_api_key is not None and _same(x_api_key.strip(), self.api_key)


def _same(given: str, key: str) -> bool:
    # Constant time: the comparison must not tell an attacker how much of a guess fits.
    return hmac.compare_digest(given.encode(), key.encode())


def is_loopback(host: str) -> bool:
    """Whether a bind address or name reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_api_exposure(address: Address, api_key: str | None, allow_open: bool) -> None:
    """Refuse to serve the API beyond this machine without a key.

    Raises ConfigError (one line, for ``meshnode join``) for a non-loopback bind with no
    key, unless ``allow_open`` says the operator means it.
    """
    if api_key is None and not allow_open and not is_loopback(address.host):
        raise ConfigError(
            f"--api {address} is reachable from other machines: set --api-key (or "
            "MESHNODE_API_KEY), bind 127.0.0.1, or pass --allow-open-api"
        )


def _host_name(host: str) -> str:
    """The name part of a ``Host`` header: ``[::1]:8470`` → ``::1``, ``a:80`` → ``a``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


# -- the ASGI layer ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Refusal:
    status: int
    message: str
    code: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


class _BodyRefused(Exception):
    def __init__(self, refusal: _Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


class _Disconnected(Exception):
    pass


class ApiGuard:
    """The ASGI layer of the module docstring, around ``app``."""

    def __init__(self, app: ASGIApp, access: ApiAccess, limits: BodyLimits) -> None:
        self.app = app
        self.access = access
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            # No route takes a websocket; refusing them here keeps them out of every check.
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = _headers(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is None:
            refusal = _declared_too_large(headers, self.limits)
        if refusal is not None:
            await _drain(receive, headers)
            await _respond(send, refusal)
            return
        try:
            body = await self._read_body(receive)
        except _Disconnected:
            return
        except _BodyRefused as exc:
            await _drain(receive, headers)
            await _respond(send, exc.refusal)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> _Refusal | None:
        host = headers.get("host")
        if not self.access.host_allowed(host):
            return _Refusal(
                400,
                f"Host {host!r} is not answered here: this API answers only "
                + (
                    "localhost, 127.0.0.1 and [::1]"
                    if self.access.hosts is HostRule.LOOPBACK
                    else "loopback names and IP addresses (set --api-key to answer names)"
                )
                + " (a defence against DNS rebinding).",
                "invalid_host",
            )
        if _is_public(scope) or self.access.key_ok(
            headers.get("authorization"), headers.get("x-api-key")
        ):
            return None
        given = "authorization" in headers or "x-api-key" in headers
        message = (
            "Incorrect API key provided."
            if given
            else "Missing API key: send it as 'Authorization: Bearer <key>'."
        )
        return _Refusal(401, message, "invalid_api_key", ((b"www-authenticate", b"Bearer"),))

    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body, or _BodyRefused (too large, too slow) / _Disconnected."""
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.limits.timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limits.max_bytes:
                    raise _BodyRefused(_too_large(self.limits))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise _BodyRefused(
            _Refusal(
                408,
                f"The request body did not arrive within {self.limits.timeout_s:g} s.",
                "request_timeout",
                ((b"connection", b"close"),),
            )
        )


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}


def _is_public(scope: Scope) -> bool:
    if scope["method"] == "OPTIONS":
        return True
    path = str(scope["path"])
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def _too_large(limits: BodyLimits) -> _Refusal:
    return _Refusal(
        413,
        f"The request body is larger than {limits.max_bytes} bytes (--api-max-body).",
        "request_too_large",
        ((b"connection", b"close"),),
    )


def _declared_too_large(headers: dict[str, str], limits: BodyLimits) -> _Refusal | None:
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        return _too_large(limits)
    return None


async def _drain(receive: Receive, headers: dict[str, str]) -> None:
    """Read and drop a refused body (bounded, see DRAIN_MAX_BYTES), so the client, which
    writes it all before it reads, gets the refusal rather than a reset."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_MAX_BYTES:
        return
    dropped = 0
    with trio.move_on_after(DRAIN_TIMEOUT_S):
        while dropped <= DRAIN_MAX_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))


async def _respond(send: Send, refusal: _Refusal) -> None:
    error = {"message": refusal.message, "type": "invalid_request_error", "param": None}
    body = json.dumps({"error": {**error, "code": refusal.code}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *refusal.headers,
    ]
    try:
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except trio.BusyResourceError:
        # The client closed after reading the head: hypercorn's reader then sends EOF on the
        # stream outside its send lock, racing our body (found by the soak). Nobody is left
        # to answer; without this, each such refusal logged an ASGI traceback at ERROR.
        return


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` once, then waits on the client (a streaming
    response listens for the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            message: dict[str, Any] = dict(await receive())
            return message
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
