"""The status API app served by hypercorn (trio worker) on a real loopback socket."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from meshnode.node.config import Address
from meshnode.serve.app import create_app, serve_api


async def test_status_route_serves_the_daemons_view_on_port_0() -> None:
    calls: list[int] = []

    def status() -> dict[str, Any]:
        calls.append(1)
        return {"node": {"node_id": "abc"}, "peers": []}

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_api, create_app(status), Address("127.0.0.1", 0))
            assert bound.port != 0
            async with httpx.AsyncClient() as client:
                ok = await client.get(f"http://{bound}/v1/mesh/status")
                missing = await client.get(f"http://{bound}/v1/nope")
            nursery.cancel_scope.cancel()
    assert ok.json() == {"node": {"node_id": "abc"}, "peers": []}
    assert missing.status_code == 404
    assert calls == [1]
