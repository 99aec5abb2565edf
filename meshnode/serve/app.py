"""The node's HTTP API: an app factory and a hypercorn (trio worker) runner.

Every node's app serves ``GET /v1/mesh/status``, ``GET /metrics``
(:mod:`meshnode.serve.node_metrics`) and the web console (``GET /``,
:mod:`meshnode.serve.console`); the host adds the OpenAI routes and its serving metrics.
The factory only takes callables that read the daemon's state, never the daemon itself.

The whole app sits behind :class:`~meshnode.net.http_guard.ApiGuard` (Host check, API key,
body limits): a route mounted on it later, by any module, is guarded without doing anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse

from meshnode.net.http import serve_api
from meshnode.net.http_guard import ApiAccess, ApiGuard, BodyLimits
from meshnode.serve.console import mount_console
from meshnode.serve.metrics import PROMETHEUS_CONTENT_TYPE
from meshnode.serve.node_metrics import RequestTimer, request_histogram, status_metrics

__all__ = ["StatusSource", "add_metrics", "create_app", "serve_api"]

StatusSource = Callable[[], dict[str, Any]]

#: Seconds a browser may cache a preflight answer: 10 minutes, Chromium's own cap, so a
#: changed ``--cors-origin`` list takes effect on pages within minutes of a restart.
CORS_MAX_AGE_S = 600


def create_app(
    mesh_status: StatusSource,
    *,
    access: ApiAccess | None = None,
    limits: BodyLimits | None = None,
    cors_origins: Sequence[str] = (),
) -> FastAPI:
    """The API app; ``mesh_status()`` returns the JSON body of ``GET /v1/mesh/status``.

    ``access`` defaults to a loopback bind without a key, ``limits`` to the default body
    limits (:mod:`meshnode.net.http_guard`). ``cors_origins`` (``--cors-origin``) are the
    browser origins allowed to call it; with none, no CORS header is sent and browsers keep
    other sites' pages out.
    """
    app = FastAPI(title="meshnode", docs_url=None, redoc_url=None, openapi_url=None)
    _serve_metrics(app, mesh_status)  # its timer is added first: the innermost layer
    app.add_middleware(ApiGuard, access=access or ApiAccess(), limits=limits or BodyLimits())
    if cors_origins:
        # Added after the guard, so outside it: refusals carry the CORS headers too, and a
        # page on an allowed origin can read why it was refused.
        _allow_origins(app, cors_origins)

    @app.get("/v1/mesh/status")
    async def get_mesh_status() -> dict[str, Any]:
        return mesh_status()

    mount_console(app)
    return app


def add_metrics(app: FastAPI, render: Callable[[], str]) -> None:
    """Append ``render()``'s exposition text (newline-terminated) to ``GET /metrics``."""
    app.state.metrics_sources.append(render)


def _serve_metrics(app: FastAPI, mesh_status: StatusSource) -> None:
    # Every node: its status as metrics and its HTTP request latencies; the host adds the
    # serving metrics (add_metrics). The timer sits inside the guard (issue 36, item 2):
    # only requests the guard let through are timed, to the last byte of a streamed reply,
    # so a stranger without the key adds nothing to /metrics.
    timings = request_histogram()
    app.add_middleware(RequestTimer, histogram=timings)
    app.state.metrics_sources = []

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [*status_metrics(mesh_status()), *timings.render()]
        text = "\n".join(lines) + "\n"
        text += "".join(render() for render in app.state.metrics_sources)
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)


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
