"""The node's HTTP API: an app factory and a hypercorn (trio worker) runner.

Every node's app serves ``GET /v1/mesh/status`` and the web console (``GET /``,
:mod:`meshnode.serve.console`); the host adds the OpenAI routes. The factory only takes
callables that read the daemon's state, never the daemon itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from meshnode.net.http import serve_api
from meshnode.serve.console import mount_console

__all__ = ["StatusSource", "create_app", "serve_api"]

StatusSource = Callable[[], dict[str, Any]]

#: Seconds a browser may cache a preflight answer: 10 minutes, Chromium's own cap, so a
#: changed ``--cors-origin`` list takes effect on pages within minutes of a restart.
CORS_MAX_AGE_S = 600


def create_app(mesh_status: StatusSource, *, cors_origins: Sequence[str] = ()) -> FastAPI:
    """The API app; ``mesh_status()`` returns the JSON body of ``GET /v1/mesh/status``.

    ``cors_origins`` (``--cors-origin``) are the browser origins allowed to call it; with
    none, no CORS header is sent and browsers keep other sites' pages out.
    """
    app = FastAPI(title="meshnode", docs_url=None, redoc_url=None, openapi_url=None)
    if cors_origins:
        _allow_origins(app, cors_origins)

    @app.get("/v1/mesh/status")
    async def get_mesh_status() -> dict[str, Any]:
        return mesh_status()

    mount_console(app)
    return app


def _allow_origins(app: FastAPI, origins: Sequence[str]) -> None:
    # Preflight (OPTIONS) is answered here, before any route or key check: a browser sends
    # no credentials on it. Headers are echoed as asked (Authorization, x-api-key, the
    # SDKs' own), and Retry-After is exposed so a page can honour a 503.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=["Retry-After"],
        max_age=CORS_MAX_AGE_S,
    )
