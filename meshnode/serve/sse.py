"""Server-sent events shared by the OpenAI and Anthropic routes."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import trio
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

__all__ = ["SSE_HEADERS", "ClosingStreamingResponse"]

#: No caching, and no buffering by a reverse proxy (nginx honours X-Accel-Buffering):
#: each event must reach the client when it is sent.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator when the response ends.

    Starlette stops iterating when the client disconnects but leaves the generator to the
    garbage collector; closing it here runs the generation's cleanup (the ``Release`` of
    the sequence on every stage) at once, in this task. ``on_close`` runs last, whether or
    not the body was ever iterated (``ServeService.finish`` of the run: its slot is freed
    even when the client left before the first byte).
    """

    body_iterator: AsyncGenerator[bytes, None]

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        *,
        on_close: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with aclosing(self.body_iterator):
                await super().__call__(scope, receive, _last_body_shielded(send))
        finally:
            if self._on_close is not None:
                self._on_close()


def _last_body_shielded(send: Send) -> Send:
    """``send``, with the body's last message sent shielded from cancellation.

    Starlette streams a body next to a task that waits for ``http.disconnect`` and cancels
    both when either ends. Hypercorn ends the exchange inside that last ``send``: it puts
    ``http.disconnect`` on the queue, which ends the waiting task and cancels the send
    while it closes (``Connection: close``) or recycles (keep-alive) the connection. Cut
    off there, the connection stayed open until the 30-minute read timeout (issue 36,
    item 12). Shielded, the close or the keep-alive timer runs as for any other reply.
    """

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                await send(message)
        else:
            await send(message)

    return sending
