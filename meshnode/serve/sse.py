"""Server-sent events shared by the OpenAI and Anthropic routes."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["SSE_HEADERS", "ClosingStreamingResponse"]

#: No caching, and no buffering by a reverse proxy (nginx honours X-Accel-Buffering):
#: each event must reach the client when it is sent.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator when the response ends.

    Starlette stops iterating when the client disconnects but leaves the generator to the
    garbage collector; closing it here runs the generation's cleanup (the ``Release`` of
    the sequence on every stage) at once, in this task.
    """

    body_iterator: AsyncGenerator[bytes, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self.body_iterator):
            await super().__call__(scope, receive, send)
