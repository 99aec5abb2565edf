"""The Anthropic Messages API over the same service: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, so tools built on the Anthropic SDK can use a mesh.

A thin adapter, as the OpenAI routes are: the system prompt becomes the chat's system
turn, the messages its turns, and the chat template renders them; a final assistant
message is a prefill that the reply continues (as Anthropic's API does). Tools, tool
choice, ``tool_use`` and ``tool_result`` blocks map onto the OpenAI route's tool machinery
(:mod:`meshnode.serve.anthropic_tools`, :class:`meshnode.serve.toolreply.BlockStream`);
structured output (``output_config.format``, or the beta's ``output_format``, a JSON
schema) is the OpenAI route's ``json_schema`` ``response_format``, enforced by the same
grammar. ``max_tokens`` is required; ``stop_sequences``, ``temperature``, ``top_p`` and
``top_k`` map to the same sampling record, and settings the request omits come from the
model's defaults (:meth:`ServeService.sampling`).

The reply's ``stop_reason`` is ``end_turn`` (the model ended), ``tool_use`` (it ended
after calling a tool), ``stop_sequence`` (with ``stop_sequence`` naming it),
``max_tokens``, or ``model_context_window_exceeded`` when the context ran out before
``max_tokens``.

Streaming follows Anthropic's event sequence, each as ``event: NAME`` plus ``data: {...}``:
``message_start``, ``content_block_start`` (a text block at once when no tools are
shown), ``ping``, then per block ``content_block_start``, ``content_block_delta``
(``text_delta`` or ``input_json_delta``)… and ``content_block_stop``; then
``message_delta`` (stop reason and output tokens) and ``message_stop``. A failure after
the stream started is one ``error`` event.

Errors have Anthropic's body, ``{"type": "error", "error": {"type", "message"}}``, with
its type names per status (``invalid_request_error``, ``not_found_error``,
``overloaded_error``…). The body is parsed here rather than by FastAPI so that a bad body
gets that shape too.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from meshnode.generation.records import GenerationRun
from meshnode.generation.state import FinishReason, GenerationParams
from meshnode.node.pipeline import PipelineError
from meshnode.serve import anthropic_schemas as a
from meshnode.serve.anthropic_tools import anthropic_tool_plan, chat_turns
from meshnode.serve.errors import (
    APIError,
    BadRequestError,
    validation_message,
)
from meshnode.serve.service import ServeService
from meshnode.serve.sse import SSE_HEADERS, ClosingStreamingResponse
from meshnode.serve.structured import request_grammar
from meshnode.serve.toolreply import BlockStream, feed_reply, reply_events
from meshnode.serve.tools import ToolPlan

__all__ = ["anthropic_error_body", "anthropic_router"]

log = logging.getLogger(__name__)

ENDPOINT = "messages"

#: Anthropic's error type for each HTTP status the API answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for a response of ``status``."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _error_response(exc: APIError) -> JSONResponse:
    body = anthropic_error_body(exc.status_code, exc.message)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers())


def anthropic_router(service: ServeService) -> APIRouter:
    """The routes of the module docstring over ``service``."""
    router = APIRouter()

    @router.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> Response:
        try:
            body = await _parse(request, a.MessagesRequest)
            body.check_supported()
            service.require_model(body.model)
            tools = anthropic_tool_plan(body.tools, body.tool_choice, service.codec.tool_format)
            # Off the event loop, as on the OpenAI route: compiling can take a while.
            response_format = body.response_format()
            grammar = await service.tokenize(
                lambda: request_grammar(response_format, tools, service.codec.special_token_id)
            )
            run = await service.start(
                lambda: _prompt(service, body.system, body.messages, tools),
                _generation(service, body, grammar),
            )
            blocks = BlockStream(tools.parser())
            if body.stream:
                return ClosingStreamingResponse(
                    _events(service, run, body.max_tokens, blocks),
                    on_close=lambda: service.finish(run),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                )
            reply = await _reply(service, run, body.max_tokens, blocks)
            return JSONResponse(reply.model_dump())
        except APIError as exc:
            return _error_response(exc)

    @router.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(request: Request) -> Response:
        try:
            body = await _parse(request, a.CountTokensRequest)
            service.require_model(body.model)
            tools = anthropic_tool_plan(body.tools, body.tool_choice, service.codec.tool_format)
            ids = await service.tokenize(
                lambda: _prompt(service, body.system, body.messages, tools)
            )
            return JSONResponse({"input_tokens": len(ids)})
        except APIError as exc:
            return _error_response(exc)

    return router


# -- request translation ------------------------------------------------------------------


_Body = TypeVar("_Body", bound=BaseModel)


async def _parse(request: Request, model: type[_Body]) -> _Body:
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequestError(_validation_message(exc)) from exc


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return "The request body is not valid JSON."
    return validation_message(errors)[0]


def _prompt(
    service: ServeService,
    system: a.Content | None,
    messages: list[a.InputMessage],
    tools: ToolPlan,
) -> list[int]:
    turns = chat_turns(a.history(messages))
    if system is not None:
        turns.insert(0, {"role": "system", "content": a.content_text(system, "system")})
    prefill = ""
    if turns[-1]["role"] == "assistant":
        # A final assistant turn is a prefill: the reply continues it.
        final = turns.pop()
        if final.get("tool_calls"):
            raise BadRequestError(
                "messages: the final assistant message calls tools; send their "
                "tool_result blocks in a user message after it.",
                param="messages",
            )
        if tools.forced:
            raise BadRequestError(
                "An assistant prefill cannot be combined with a tool_choice that forces a "
                "tool call.",
                param="tool_choice",
            )
        prefill = final["content"]
    if not any(turn["role"] != "system" for turn in turns):
        raise BadRequestError(
            "messages: a user message must come before the assistant's prefill.",
            param="messages",
        )
    return service.chat_prompt(turns, tools.shown, continue_with=prefill)


def _generation(
    service: ServeService, body: a.MessagesRequest, grammar: str | None
) -> GenerationParams:
    sampling = service.sampling(body.sampling_fields())
    return GenerationParams(
        body.max_tokens, sampling, body.stops(), grammar=grammar, cache_prompt=body.cache_prompt
    )


# -- replies --------------------------------------------------------------------------------


def _stop_reason(run: GenerationRun, max_tokens: int, blocks: BlockStream) -> a.StopReason | None:
    state = run.state
    if state.finish_reason is None:
        return None
    if state.finish_reason is FinishReason.LENGTH:
        cut_by_context = run.params.budget < max_tokens
        return "model_context_window_exceeded" if cut_by_context else "max_tokens"
    if state.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if blocks.made_calls else "end_turn"


def _usage(run: GenerationRun) -> a.Usage:
    # As Anthropic counts: input_tokens are those not read from the cache.
    return a.Usage(
        input_tokens=len(run.prompt) - run.cached_tokens,
        output_tokens=len(run.state.tokens),
        cache_read_input_tokens=run.cached_tokens,
    )


def _message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


async def _reply(
    service: ServeService, run: GenerationRun, max_tokens: int, blocks: BlockStream
) -> a.Message:
    feed_reply(blocks, await service.reply(run, ENDPOINT))
    content = [_block(block) for block in blocks.blocks()]
    return a.Message(
        id=_message_id(),
        model=service.model_id,
        content=content,
        stop_reason=_stop_reason(run, max_tokens, blocks),
        stop_sequence=run.state.stop_string,
        usage=_usage(run),
    )


def _block(block: dict[str, Any]) -> a.TextBlock | a.ToolUseBlock:
    if block["type"] == "tool_use":
        return a.ToolUseBlock(**block)
    return a.TextBlock(**block)


def _event(name: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": name, **payload}, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


async def _events(
    service: ServeService, run: GenerationRun, max_tokens: int, blocks: BlockStream
) -> AsyncGenerator[bytes, None]:
    """Anthropic's stream of one reply (see the module docstring)."""
    start = a.Message(
        id=_message_id(),
        model=service.model_id,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=a.Usage(input_tokens=len(run.prompt), output_tokens=0),
    )
    yield _event("message_start", {"message": start.model_dump(exclude_none=False)})
    for name, payload in blocks.start():
        yield _event(name, payload)
    yield _event("ping", {})
    outcome = "cancelled"
    try:
        async with aclosing(reply_events(service.stream(run), blocks)) as events:
            async for name, payload in events:
                yield _event(name, payload)
        outcome = "ok"
    except (PipelineError, APIError) as exc:
        outcome = "error"
        log.warning("stream failed: %s", exc)
        status = exc.status_code if isinstance(exc, APIError) else 503
        message = exc.message if isinstance(exc, APIError) else str(exc)
        yield _event("error", {"error": anthropic_error_body(status, message)["error"]})
        return
    finally:
        service.metrics.requests.inc(endpoint=ENDPOINT, outcome=outcome)
    stop = {
        "stop_reason": _stop_reason(run, max_tokens, blocks),
        "stop_sequence": run.state.stop_string,
    }
    usage = _usage(run).model_dump()  # the final counts, cache reads included
    yield _event("message_delta", {"delta": stop, "usage": usage})
    yield _event("message_stop", {})
