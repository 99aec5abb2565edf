"""Serving an ASGI app (the node's HTTP API) with hypercorn's trio worker."""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

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


async def serve_api(
    app: Any,
    address: Address,
    *,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``address`` until cancelled; ``started()`` gets the bound address.

    With port 0 the OS picks a port; the started value says which.
    """

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve, app, _hypercorn_config(address))
        bound = Address.parse(binds[0].split("://", 1)[1])
        log.info("api: listening on http://%s", bound)
        task_status.started(bound)
