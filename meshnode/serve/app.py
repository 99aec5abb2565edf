"""The node's HTTP API: an app factory and a hypercorn (trio worker) runner.

Every node's app serves ``GET /v1/mesh/status`` and the web console (``GET /``,
:mod:`meshnode.serve.console`); the host adds the OpenAI routes. The factory only takes
callables that read the daemon's state, never the daemon itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from meshnode.net.http import serve_api
from meshnode.serve.console import mount_console

__all__ = ["StatusSource", "create_app", "serve_api"]

StatusSource = Callable[[], dict[str, Any]]


def create_app(mesh_status: StatusSource) -> FastAPI:
    """The API app; ``mesh_status()`` returns the JSON body of ``GET /v1/mesh/status``."""
    app = FastAPI(title="meshnode", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/v1/mesh/status")
    async def get_mesh_status() -> dict[str, Any]:
        return mesh_status()

    mount_console(app)
    return app
