"""Serving an ASGI app (the node's HTTP API) with hypercorn's trio worker.

The listening socket is bound here, before any task starts, so an address in use is one
``OSError`` at the call site (which ``join`` reports as a one-line error naming ``--api``)
rather than an exception group from inside hypercorn's nurseries.
"""

from __future__ import annotations

import logging
import socket
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from meshnode.net.address import Address

log = logging.getLogger(__name__)

#: Seconds a connection may sit idle between requests, and the time a new connection has to
#: send its request headers (hypercorn's keep-alive timer runs until the headers are in, so
#: this also ends a slow-loris header trickle). Longer than the 5 s after which httpx (and
#: so the openai client) drops an idle pooled connection: the client closes first, so it
#: never reuses a connection the server is closing under it.
HTTP_KEEP_ALIVE_S = 10.0
#: Seconds a connection may go without a byte from the client. A client reading a streamed
#: reply sends nothing, so this must outlast the longest generation anyone waits for; it
#: frees connections of clients that vanished without a FIN or stopped reading (hypercorn
#: waits on the write until then). Body uploads have their own, shorter deadline
#: (``http_guard.BodyLimits.timeout_s``).
HTTP_READ_TIMEOUT_S = 30 * 60
#: Bytes of request line and headers hypercorn buffers before answering 431; an OpenAI
#: request's headers are well under 2 KiB (hypercorn's own default).
HTTP_MAX_HEADER_BYTES = 16 * 1024


def _hypercorn_config(address: Address) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [str(address)]
    config.keep_alive_timeout = HTTP_KEEP_ALIVE_S
    config.read_timeout = HTTP_READ_TIMEOUT_S
    config.h11_max_incomplete_size = HTTP_MAX_HEADER_BYTES
    config.accesslog = None
    # Through our logging setup, not a second handler of hypercorn's own.
    config.errorlog = logging.getLogger("hypercorn.error")
    # Shutdown must not wait long for idle keep-alive clients: the daemon is exiting.
    config.graceful_timeout = 1.0
    return config


def bind_tcp(address: Address, backlog: int) -> socket.socket:
    """A non-blocking TCP socket listening on ``address``.

    Raises ``OSError`` (``EADDRINUSE``, ``EADDRNOTAVAIL``, ...) with the socket closed.
    """
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As hypercorn binds: a restarted node reuses its port through TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((address.host, address.port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_api(
    app: Any,
    address: Address,
    *,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``address`` until cancelled; ``started()`` gets the bound address.

    With port 0 the OS picks a port; the started value says which. Raises ``OSError``
    before starting when the address cannot be bound.
    """
    config = _hypercorn_config(address)
    sock = bind_tcp(address, config.backlog)
    sockets = Sockets([], [sock], [])
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    # Closed here too: hypercorn closes it with its listener, but not on a failed start.
    with sock:
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                partial(worker_serve, asgi, config, sockets=sockets)
            )
            bound = Address.parse(binds[0].split("://", 1)[1])
            log.info("api: listening on http://%s", bound)
            task_status.started(bound)
