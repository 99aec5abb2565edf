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


def _hypercorn_config(address: Address) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [str(address)]
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
