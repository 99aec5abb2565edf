"""OpenAI's Responses API over the same service: ``POST /v1/responses``, so clients built
on it (the ``openai`` SDK's ``client.responses``, agent frameworks) can use a mesh.

A thin adapter: the request becomes a chat (:mod:`meshnode.serve.responses_schemas`), which
is rendered, parsed for function calls and constrained (``text.format``, a forced
``tool_choice``) exactly as a chat completion is. The reply's text and calls are cut into
output items by :class:`~meshnode.serve.toolreply.BlockStream`, as the Anthropic route's are
(a text block is a ``message`` item with one ``output_text`` part, a call a
``function_call`` item), so the streamed items always reassemble to the whole response.

The response is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the token budget (or the context) ran out. Nothing is stored:
``store`` is accepted and ignored, and a response cannot be fetched again.

Streaming sends Responses events, each as ``event: TYPE`` plus ``data: {...}`` with a
``sequence_number``: ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``…, ``response.output_text.done`` and
``response.content_part.done``, for a call ``response.function_call_arguments.delta``… and
``response.function_call_arguments.done``, then ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete``). A failure after the stream started is
one ``error`` event.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from meshnode.generation.records import GenerationRun
from meshnode.generation.state import FinishReason, GenerationParams
from meshnode.node.pipeline import PipelineError
from meshnode.serve.errors import APIError
from meshnode.serve.responses_schemas import ResponsesRequest
from meshnode.serve.service import ServeService
from meshnode.serve.sse import SSE_HEADERS, ClosingStreamingResponse
from meshnode.serve.structured import request_grammar
from meshnode.serve.toolreply import BlockStream, Event, feed_reply, reply_events
from meshnode.serve.tools import ToolPlan

__all__ = ["responses_router"]

log = logging.getLogger(__name__)

ENDPOINT = "responses"


def responses_router(service: ServeService) -> APIRouter:
    """The route of the module docstring over ``service``."""
    router = APIRouter()

    @router.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest) -> Response:
        body.check_supported()
        service.require_model(body.model)
        tools = body.tool_plan(service.codec.tool_format)
        response_format = body.response_format()
        grammar = await service.tokenize(
            lambda: request_grammar(response_format, tools, service.codec.special_token_id)
        )
        sampling = service.sampling(body.sampling_fields())
        request = GenerationParams(body.max_output_tokens, sampling, grammar=grammar)
        turns = body.turns()
        run = await service.start(lambda: service.chat_prompt(turns, tools.shown), request)
        items = ItemStream(BlockStream(tools.parser()))
        header = _header(service, body, tools)
        if body.stream:
            return ClosingStreamingResponse(
                _events(service, run, items, header),
                on_close=lambda: service.finish(run),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        return JSONResponse(await _whole(service, run, items, header))

    return router


# -- output items ---------------------------------------------------------------------------


@dataclass(slots=True)
class ItemStream:
    """The response's output items and their stream events, from the reply's content
    blocks (module docstring): block ``i`` is output item ``i``."""

    blocks: BlockStream
    _ids: list[str] = field(default_factory=list)  # each item's id
    _items: list[dict[str, Any]] = field(default_factory=list)  # finished items

    def start(self) -> list[Event]:
        """The events that open the reply."""
        return self._translate(self.blocks.start())

    def push(self, text: str, final: bool) -> list[Event]:
        """The events for the next piece of the reply (see :meth:`BlockStream.push`)."""
        return self._translate(self.blocks.push(text, final))

    @property
    def items(self) -> list[dict[str, Any]]:
        """The finished output items (all of them once the final piece was pushed)."""
        return list(self._items)

    def _translate(self, events: list[Event]) -> list[Event]:
        return [out for name, payload in events for out in self._one(name, payload)]

    def _one(self, name: str, payload: dict[str, Any]) -> list[Event]:
        index = payload["index"]
        if name == "content_block_start":
            return self._added(index, payload["content_block"])
        if name == "content_block_stop":
            return self._done(index)
        delta = payload["delta"]
        where = {"item_id": self._ids[index], "output_index": index}
        if delta["type"] == "text_delta":
            piece = {**where, "content_index": 0, "delta": delta["text"], "logprobs": []}
            return [("response.output_text.delta", piece)]
        return [
            ("response.function_call_arguments.delta", {**where, "delta": delta["partial_json"]})
        ]

    def _added(self, index: int, block: dict[str, Any]) -> list[Event]:
        if block["type"] == "text":
            self._ids.append(_id("msg"))
            item = _message(self._ids[index], "", "in_progress")
            part = {"item_id": self._ids[index], "output_index": index, "content_index": 0,
                    "part": _text_part("")}  # fmt: skip
            return [
                (
                    "response.output_item.added",
                    {"output_index": index, "item": {**item, "content": []}},
                ),
                ("response.content_part.added", part),
            ]
        self._ids.append(_id("fc"))
        item = _call(self._ids[index], block, "", "in_progress")
        return [("response.output_item.added", {"output_index": index, "item": item})]

    def _done(self, index: int) -> list[Event]:
        block = self.blocks.block(index)
        where = {"item_id": self._ids[index], "output_index": index}
        if block["type"] == "text":
            item = _message(self._ids[index], block["text"], "completed")
            events: list[Event] = [
                ("response.output_text.done",
                 {**where, "content_index": 0, "text": block["text"], "logprobs": []}),
                ("response.content_part.done",
                 {**where, "content_index": 0, "part": _text_part(block["text"])}),
            ]  # fmt: skip
        else:
            item = _call(self._ids[index], block, block["input"], "completed")
            done = {**where, "name": item["name"], "arguments": item["arguments"]}
            events = [("response.function_call_arguments.done", done)]
        self._items.append(item)
        return [*events, ("response.output_item.done", {"output_index": index, "item": item})]


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(ident: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": ident, "status": status, "role": "assistant",
            "content": [_text_part(text)]}  # fmt: skip


def _call(ident: str, block: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    call_id = "call_" + str(block["id"]).removeprefix("toolu_")
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": block["name"],
            "arguments": arguments, "status": status}  # fmt: skip


# -- responses ------------------------------------------------------------------------------


def _header(service: ServeService, body: ResponsesRequest, tools: ToolPlan) -> dict[str, Any]:
    """The fields of the response object that the request decides."""
    choice = body.tool_choice if body.tool_choice is not None else tools.choice.mode
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": service.now(),
        "model": service.model_id,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": tools.parallel,
        "tool_choice": choice,
        "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "metadata": {},
        "error": None,
    }


def _response(
    header: dict[str, Any], run: GenerationRun | None, items: list[dict[str, Any]]
) -> dict[str, Any]:
    """The response object: in progress while ``run`` is None or unfinished."""
    state = None if run is None else run.state.finish_reason
    status, details = "in_progress", None
    if state is FinishReason.LENGTH:
        status, details = "incomplete", {"reason": "max_output_tokens"}
    elif state is not None:
        status = "completed"
    out = {**header, "status": status, "incomplete_details": details, "output": items}
    if run is not None and state is not None:
        prompt, completion = len(run.prompt), len(run.state.tokens)
        out["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }
    else:
        out["usage"] = None
    return out


async def _whole(
    service: ServeService, run: GenerationRun, items: ItemStream, header: dict[str, Any]
) -> dict[str, Any]:
    feed_reply(items, await service.reply(run, ENDPOINT))
    return _response(header, run, items.items)


@dataclass(slots=True)
class _Numbered:
    """Server-sent events with the Responses API's ``sequence_number``."""

    next: int = 0

    def event(self, name: str, payload: dict[str, Any]) -> bytes:
        body = {"type": name, "sequence_number": self.next, **payload}
        self.next += 1
        return f"event: {name}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def _events(
    service: ServeService, run: GenerationRun, items: ItemStream, header: dict[str, Any]
) -> AsyncGenerator[bytes, None]:
    """The Responses API's stream of one response (see the module docstring)."""
    sse = _Numbered()
    yield sse.event("response.created", {"response": _response(header, None, [])})
    yield sse.event("response.in_progress", {"response": _response(header, None, [])})
    for name, payload in items.start():
        yield sse.event(name, payload)
    outcome = "cancelled"
    try:
        async with aclosing(reply_events(service.stream(run), items)) as events:
            async for name, payload in events:
                yield sse.event(name, payload)
        outcome = "ok"
    except (PipelineError, APIError) as exc:
        outcome = "error"
        log.warning("stream failed: %s", exc)
        code = exc.code if isinstance(exc, APIError) else "pipeline_failed"
        message = exc.message if isinstance(exc, APIError) else str(exc)
        yield sse.event("error", {"code": code, "message": message, "param": None})
        return
    finally:
        service.metrics.requests.inc(endpoint=ENDPOINT, outcome=outcome)
    final = _response(header, run, items.items)
    name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield sse.event(name, {"response": final})
