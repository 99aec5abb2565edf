"""A connection after a streamed reply (issue 36, item 12).

Before, a connection that had carried a streamed (SSE) reply stayed open until the
30-minute read timeout: neither ``Connection: close`` nor the 10 s keep-alive applied to
it, so idle clients could pin connections (and their tasks) for half an hour each. Now the
server closes it after the reply when the client asked to close, and after the keep-alive
time when the client keeps it idle.
"""

from __future__ import annotations

import json

import pytest
import trio

from meshnode.net.http import HTTP_KEEP_ALIVE_S
from tests.serve.conftest import TINY_MODEL_ID, Server

#: The keep-alive time plus a margin for a loaded machine: well under the read timeout.
CLOSE_WITHIN_S = HTTP_KEEP_ALIVE_S + 10.0


def _request(path: str, body: dict[str, object], connection: str) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: {connection}\r\n\r\n"
    )
    return head.encode() + data


@pytest.mark.parametrize("connection", ["close", "keep-alive"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_the_server_ends_the_connection_after_a_reply(
    server: Server, connection: str, stream: bool
) -> None:
    body = {"model": TINY_MODEL_ID, "prompt": "Once", "max_tokens": 3, "stream": stream}
    sock = await trio.open_tcp_stream(server.address.host, server.address.port)
    async with sock:
        await sock.send_all(_request("/v1/completions", body, connection))
        answer = b""
        with trio.fail_after(CLOSE_WITHIN_S):
            while data := await sock.receive_some():  # b"": the server closed
                answer += data
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert (b"data: [DONE]" in answer) == stream
