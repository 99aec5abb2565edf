"""OpenAI-compatible routes: thin adapters from the OpenAI schema to :class:`ServeService`.

``openai_router(service)`` serves ``GET /v1/models`` (and ``/v1/models/{id}``, both read
by the Anthropic SDK too),
``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent events
ending in ``data: [DONE]``, or one JSON body) and ``GET /health``.
``mount_openai(app, service)`` adds them, ``/tokenize`` and ``/detokenize``
(:mod:`meshnode.serve.tokens_api`), the Anthropic Messages API
(:mod:`meshnode.serve.anthropic_api`), OpenAI's Responses API
(:mod:`meshnode.serve.responses_api`), the serving metrics (to ``GET /metrics``) and the
OpenAI-shaped error handlers to the node's app (``meshnode.serve.app``).

A failure after a stream has started cannot change the status code any more; it is sent
as one ``data: {"error": {...}}`` event before ``[DONE]``, which the official clients
raise as an ``APIError``.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from meshnode.generation.records import GenerationRun
from meshnode.generation.state import Delta, GenerationParams
from meshnode.node.pipeline import PipelineError, TokenLogprob
from meshnode.serve import schemas as s
from meshnode.serve.anthropic_api import anthropic_router
from meshnode.serve.app import add_metrics
from meshnode.serve.errors import (
    APIError,
    ServiceUnavailableError,
    error_body,
    install_error_handlers,
)
from meshnode.serve.responses_api import responses_router
from meshnode.serve.service import ServeService
from meshnode.serve.sse import SSE_HEADERS, ClosingStreamingResponse
from meshnode.serve.structured import request_grammar
from meshnode.serve.tokens_api import tokens_router
from meshnode.serve.toolreply import ReplyShaper
from meshnode.serve.tools import ToolPlan, tool_plan

log = logging.getLogger(__name__)

#: A text completion shows no tools.
NO_TOOLS = ToolPlan()


def mount_openai(app: FastAPI, service: ServeService) -> None:
    """Add the OpenAI routes, ``/metrics``, ``/health`` and the error handlers to ``app``."""
    app.include_router(openai_router(service))
    add_metrics(app, service.metrics.render)
    app.include_router(tokens_router(service))
    app.include_router(anthropic_router(service))
    app.include_router(responses_router(service))
    install_error_handlers(app)


def openai_router(service: ServeService) -> APIRouter:
    """The routes of the OpenAI-compatible API over ``service``."""
    router = APIRouter()

    def model_card() -> s.ModelCard:
        return s.ModelCard.of(service.model_id, service.created, service.context_size)

    @router.get("/v1/models")
    async def list_models() -> s.ModelList:
        return s.ModelList.of([model_card()])

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> s.ModelCard:
        service.require_model(model)
        return model_card()

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: s.ChatCompletionRequest) -> Any:
        body.check_supported()
        service.require_model(body.model)
        tools = tool_plan(
            body.tools, body.tool_choice, service.codec.tool_format, body.parallel_tool_calls
        )
        # Compiling a schema can take a while (llguidance checks the whole grammar): off
        # the event loop, like tokenizing.
        grammar = await service.tokenize(
            lambda: request_grammar(
                body.response_format,
                tools,
                service.codec.special_token_id,
                body.other_constraints(),
            )
        )
        turns, prefill, opened = body.template_turns([m.as_dict() for m in body.messages])
        sampling = _chat_sampling(service, body, grammar)
        run = await service.start(
            lambda: service.chat_prompt(
                turns, tools.shown, continue_with=prefill, add_generation_prompt=opened
            ),
            sampling,
        )
        shaper = ReplyShaper(tools.parser(), tools.calls_finish_reason)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = _chat_chunks(service, run, include_usage, shaper)
            return _sse_response(service, "chat", run, chunks)
        deltas = await service.reply(run, "chat")
        return _chat_body(service, run, deltas, shaper)

    @router.post("/v1/completions", response_model=None)
    async def completions(body: s.CompletionRequest) -> Any:
        body.check_supported()
        service.require_model(body.model)
        prompt = body.single_prompt()
        grammar = await service.tokenize(
            lambda: request_grammar(
                body.response_format,
                NO_TOOLS,
                service.codec.special_token_id,
                body.other_constraints(),
            )
        )
        sampling = _text_sampling(service, body, grammar)
        run = await service.start(lambda: service.text_prompt(prompt), sampling)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = _text_chunks(service, run, include_usage, body.return_token_ids)
            return _sse_response(service, "completions", run, chunks)
        deltas = await service.reply(run, "completions")
        return _text_body(service, run, deltas, body.return_token_ids)

    @router.get("/health")
    async def health() -> JSONResponse:
        if not service.ready:
            exc = ServiceUnavailableError(service.unavailable_reason())
            body = {"status": "loading", "message": exc.message}
            return JSONResponse(body, status_code=503, headers=exc.headers())
        return JSONResponse({"status": "ok", "model": service.model_id})

    return router


# -- request translation ------------------------------------------------------------------


def _chat_sampling(
    service: ServeService, body: s.ChatCompletionRequest, grammar: str | None
) -> GenerationParams:
    return GenerationParams(
        body.token_limit(),
        service.sampling(body.sampling_fields()),
        tuple(body.stop_list()),
        top_logprobs=body.logprob_count(),
        grammar=grammar,
        cache_prompt=body.cache_prompt,
    )


def _text_sampling(
    service: ServeService, body: s.CompletionRequest, grammar: str | None
) -> GenerationParams:
    sampling = service.sampling(body.sampling_fields())
    stops = tuple(body.stop_list())
    return GenerationParams(
        body.max_tokens,
        sampling,
        stops,
        top_logprobs=body.logprobs,
        grammar=grammar,
        cache_prompt=body.cache_prompt,
    )


# -- running ------------------------------------------------------------------------------


def _sse_response(
    service: ServeService,
    endpoint: str,
    run: GenerationRun,
    chunks: AsyncGenerator[BaseModel, None],
) -> StreamingResponse:
    return ClosingStreamingResponse(
        _sse(service, endpoint, chunks),
        on_close=lambda: service.finish(run),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _sse(
    service: ServeService, endpoint: str, chunks: AsyncGenerator[BaseModel, None]
) -> AsyncGenerator[bytes, None]:
    """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``."""
    outcome = "cancelled"
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield _event(chunk.model_dump(mode="json"))
        outcome = "ok"
    except (PipelineError, APIError) as exc:
        outcome = "error"
        log.warning("stream failed: %s", exc)
        yield _event(_stream_error(exc))
    finally:
        service.metrics.requests.inc(endpoint=endpoint, outcome=outcome)
    yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _stream_error(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, APIError):
        return error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)
    return error_body(str(exc), "server_error", code="pipeline_failed")


def _usage(run: GenerationRun) -> s.Usage:
    prompt, completion = len(run.prompt), len(run.state.tokens)
    return s.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=run.cached_tokens),
    )


def _telemetry(run: GenerationRun) -> dict[str, Any]:
    timings = run.timings
    return {
        "speculation": {"strategy": run.strategy, **run.spec.as_dict()},
        "timings": {
            "time_to_first_token_s": timings.ttft_s,
            "time_per_output_token_s": timings.tpot_s(len(run.state.tokens)),
            "passes": timings.passes,
            "pass_s": timings.pass_s,
            "compute_s": timings.compute_s,
        },
    }


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


# -- chat ---------------------------------------------------------------------------------


#: The logprob OpenAI writes for a token too unlikely to measure; JSON has no -inf.
UNLIKELY_LOGPROB = -9999.0


def api_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it: within [:data:`UNLIKELY_LOGPROB`, 0], and NaN (a
    stage's nonsense, issue 36, item 11) as :data:`UNLIKELY_LOGPROB`."""
    if math.isnan(logprob):
        return UNLIKELY_LOGPROB
    return min(0.0, max(UNLIKELY_LOGPROB, logprob))


def _chat_logprobs(service: ServeService, items: tuple[TokenLogprob, ...]) -> s.ChoiceLogprobs:
    def entry(token: int, logprob: float) -> s.TopLogprob:
        text = service.codec.token_text(token)
        return s.TopLogprob(token=text, logprob=api_logprob(logprob), bytes=list(text.encode()))

    content = [
        s.TokenLogprob(
            **entry(item.token, item.logprob).model_dump(),
            top_logprobs=[entry(t, lp) for t, lp in item.top],
        )
        for item in items
    ]
    return s.ChoiceLogprobs(content=content)


def _chat_body(
    service: ServeService, run: GenerationRun, deltas: list[Delta], shaper: ReplyShaper
) -> s.ChatCompletion:
    logprobs = None
    if run.params.top_logprobs is not None:
        items = tuple(item for d in deltas for item in d.logprobs)
        logprobs = _chat_logprobs(service, items)
    message, finish_reason = shaper.message([d.text for d in deltas], run.state.finish_reason)
    choice = s.ChatChoice(message=message, logprobs=logprobs, finish_reason=finish_reason)
    return s.ChatCompletion(
        id=_completion_id("chatcmpl"),
        created=service.now(),
        model=service.model_id,
        choices=[choice],
        usage=_usage(run),
        meshnode=_telemetry(run),
    )


async def _chat_chunks(
    service: ServeService, run: GenerationRun, include_usage: bool, shaper: ReplyShaper
) -> AsyncGenerator[BaseModel, None]:
    ident, created = _completion_id("chatcmpl"), service.now()

    def chunk(choices: list[s.ChatChunkChoice], **extra: Any) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(
            id=ident, created=created, model=service.model_id, choices=choices, **extra
        )

    # OpenAI opens every chat stream with the role and empty content.
    yield chunk([s.ChatChunkChoice(delta=s.ChatDelta(role="assistant", content=""))])
    async with aclosing(service.stream(run)) as deltas:
        async for delta in deltas:
            piece, finish_reason = shaper.push(delta.text, delta.finish_reason)
            if piece is None and finish_reason is None and not delta.logprobs:
                continue
            logprobs = _chat_logprobs(service, delta.logprobs) if delta.logprobs else None
            choice = s.ChatChunkChoice(
                delta=piece or s.ChatDelta(), logprobs=logprobs, finish_reason=finish_reason
            )
            final = delta.finish_reason is not None
            yield chunk([choice], meshnode=_telemetry(run) if final else None)
    if include_usage:
        yield chunk([], usage=_usage(run))


# -- completions --------------------------------------------------------------------------


def _text_logprobs(
    service: ServeService, items: tuple[TokenLogprob, ...], offset: int
) -> s.CompletionLogprobs:
    tokens = [service.codec.token_text(item.token) for item in items]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops = [{service.codec.token_text(t): api_logprob(lp) for t, lp in item.top} for item in items]
    return s.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[api_logprob(item.logprob) for item in items],
        top_logprobs=tops,
        text_offset=offsets,
    )


def _text_body(
    service: ServeService, run: GenerationRun, deltas: list[Delta], token_ids: bool
) -> s.Completion:
    logprobs = None
    if run.params.top_logprobs is not None:
        items = tuple(item for d in deltas for item in d.logprobs)
        logprobs = _text_logprobs(service, items, 0)
    choice = s.CompletionChoice(
        text="".join(d.text for d in deltas),
        logprobs=logprobs,
        finish_reason=run.state.finish_reason,
        prompt_token_ids=list(run.prompt) if token_ids else None,
        token_ids=[t for d in deltas for t in d.tokens] if token_ids else None,
    )
    return s.Completion(
        id=_completion_id("cmpl"),
        created=service.now(),
        model=service.model_id,
        choices=[choice],
        usage=_usage(run),
        meshnode=_telemetry(run),
    )


async def _text_chunks(
    service: ServeService, run: GenerationRun, include_usage: bool, token_ids: bool
) -> AsyncGenerator[BaseModel, None]:
    ident, created = _completion_id("cmpl"), service.now()
    make: Callable[..., s.Completion] = s.Completion
    offset = 0
    prompt_ids: list[int] | None = list(run.prompt) if token_ids else None
    async with aclosing(service.stream(run)) as deltas:
        async for delta in deltas:
            carries_ids = token_ids and bool(delta.tokens)
            if not (delta.text or delta.finish_reason or delta.logprobs or carries_ids):
                continue
            logprobs = None
            if delta.logprobs:
                logprobs = _text_logprobs(service, delta.logprobs, offset)
            offset += len(delta.text)
            choice = s.CompletionChoice(
                text=delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                prompt_token_ids=prompt_ids,
                token_ids=list(delta.tokens) if token_ids else None,
            )
            prompt_ids = None  # the first chunk carries them
            final = delta.finish_reason is not None
            yield make(
                id=ident,
                created=created,
                model=service.model_id,
                choices=[choice],
                meshnode=_telemetry(run) if final else None,
            )
    if include_usage:
        yield make(id=ident, created=created, model=service.model_id, choices=[], usage=_usage(run))
