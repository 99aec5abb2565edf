"""The node's HTTP API: an app factory and a hypercorn (trio worker) runner.

Today the app serves ``GET /v1/mesh/status``; the OpenAI routes join the same app later, so
the factory only takes callables that read the daemon's state, never the daemon itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from fastapi import FastAPI
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from meshnode.node.config import Address

log = logging.getLogger(__name__)

StatusSource = Callable[[], dict[str, Any]]


def create_app(mesh_status: StatusSource) -> FastAPI:
    """The API app; ``mesh_status()`` returns the JSON body of ``GET /v1/mesh/status``."""
    app = FastAPI(title="meshnode", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/v1/mesh/status")
    async def get_mesh_status() -> dict[str, Any]:
        return mesh_status()

    return app


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
    app: FastAPI,
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
