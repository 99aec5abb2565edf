"""The web console: one page, served by every node at ``GET /``, with its assets in the package.

The page is static (HTML, CSS and ES modules under ``static/``, no build step, nothing
fetched from elsewhere) and reads everything it shows from the node's own API:
``/v1/mesh/status`` and ``/metrics`` for the mesh and speed views, and
``/v1/chat/completions`` (streamed) for the playground on the host. The page and its assets
carry no data, so they are served without the API key; every data request the page makes
sends the key the user entered as ``Authorization: Bearer`` and asks for it on a 401.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

__all__ = ["ASSETS", "console_router", "mount_console"]

#: Every file the page loads, with its content type. Only these names are served, so a
#: request path can never reach another file of the package.
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "ui.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "mesh.js": "text/javascript; charset=utf-8",
    "speed.js": "text/javascript; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "main.js": "text/javascript; charset=utf-8",
}

# A new meshnode version may change the page: the browser revalidates instead of running
# old scripts against a new API (the files are small, a 304 costs nothing).
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def _load_assets() -> dict[str, bytes]:
    # Read once: the files are part of the installed package (package-data), never edited
    # while the node runs. A missing one is a broken install and fails the node's start.
    folder = resources.files(__name__) / "static"
    return {name: (folder / name).read_bytes() for name in ASSETS}


def console_router() -> APIRouter:
    """``GET /`` (the page) and ``GET /console/{name}`` (its assets).

    Raises FileNotFoundError when the installed package lacks an asset.
    """
    files = _load_assets()
    router = APIRouter()

    def asset(name: str) -> Response:
        return Response(files[name], media_type=ASSETS[name], headers=_HEADERS)

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return asset("index.html")

    @router.get("/console/{name}", include_in_schema=False)
    async def console_asset(name: str) -> Response:
        if name not in files:
            return Response("no such console file\n", status_code=404, media_type="text/plain")
        return asset(name)

    return router


def mount_console(app: FastAPI) -> None:
    """Serve the console on ``app``."""
    app.include_router(console_router())
