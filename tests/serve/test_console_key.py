"""The console's API key flow, in headless Chromium (issue 20).

The app has an API key (``meshnode.net.http_guard``): every data route refuses a request
without ``Authorization: Bearer <key>``, while the page and its assets load without one.
The page must ask for the key on the 401, send it, and show the node. Skipped where
Chromium is not installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from fastapi import Request, Response

from meshnode.net.http_guard import ApiAccess
from meshnode.node.config import Address
from meshnode.serve.app import create_app, serve_api
from tests.e2e.browser import Browser, find_chromium

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (apt-get install chromium): the console's "
    "browser test needs a real browser",
)

KEY = "s3cret-key"
PAGE_TIMEOUT_S = 20.0
NODE_ID = "0123456789abcdef"
#: A worker's status body with no peers and no run (what a freshly started worker shows).
STATUS: dict[str, Any] = {
    "node": {
        "node_id": NODE_ID,
        "mesh_name": "keyed",
        "listen": "127.0.0.1:7470",
        "api": "127.0.0.1:8470",
        "device": "cpu",
        "usable_memory": 8 << 30,
        "uptime_s": 12.0,
        "refused_handshakes": 0,
        "protocol_errors": 0,
        "internal_errors": 0,
    },
    "peers": [],
}

Handler = Callable[[Request], Awaitable[Response]]


def _keyed_app() -> Any:
    app = create_app(lambda: STATUS, access=ApiAccess(KEY))
    seen: list[str] = []

    @app.middleware("http")  # outside the guard: sees every request, refused ones too
    async def record_key(request: Request, call_next: Handler) -> Response:
        if request.url.path.startswith(("/v1/", "/metrics")):
            seen.append(request.headers.get("authorization", ""))
        return await call_next(request)

    app.state.seen = seen
    return app


def _drive(url: str, tmp_path: Path) -> tuple[str, str]:
    assert CHROMIUM is not None
    with Browser(CHROMIUM, tmp_path / "profile", tmp_path / "chromium.log") as browser:
        browser.open_page(1100, 700)
        browser.navigate(url)
        reason = browser.wait_for(
            "document.getElementById('key-dialog')?.hidden === false && "
            "document.getElementById('key-reason').textContent",
            PAGE_TIMEOUT_S,
            "the key dialog",
        )
        browser.evaluate(
            f"document.getElementById('key-input').value = '{KEY}';"
            "document.getElementById('key-form').requestSubmit(); true"
        )
        browser.wait_for("document.body.dataset.loaded === 'true'", PAGE_TIMEOUT_S, "the node")
        shown: str = browser.evaluate("document.getElementById('header-facts').innerText")
        return str(reason), shown


async def test_the_page_asks_for_the_key_and_sends_it_as_bearer(tmp_path: Path) -> None:
    app = _keyed_app()
    async with trio.open_nursery() as nursery:
        address: Address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
        reason, shown = await trio.to_thread.run_sync(_drive, f"http://{address}/", tmp_path)
        nursery.cancel_scope.cancel()
    assert "Missing API key" in reason
    assert NODE_ID in shown
    assert app.state.seen[0] == ""  # the first poll had no key
    assert app.state.seen[-1] == f"Bearer {KEY}"
