"""OpenAI-shaped errors for the HTTP API.

Every error the API returns has the body OpenAI's own API uses, which the official clients
parse into typed exceptions::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Exception tree (raise these from handlers and the service; the handlers installed by
:func:`install_error_handlers` map them, and FastAPI's validation errors, to responses):

- :class:`APIError` — base; carries the HTTP status, error type, param and code.
  - :class:`BadRequestError` (400) — a body that parses but asks for something we refuse
    (``n`` > 1, tools, a prompt batch).
  - :class:`ModelNotFoundError` (404) — ``model`` names no model this node serves.
  - :class:`ContextLengthError` (400, ``context_length_exceeded``, as OpenAI answers) —
    the prompt alone does not fit the context.
  - :class:`ServiceUnavailableError` (503 + ``Retry-After``) — the mesh is (re)loading, or
    the admission queue is full.

A bad body never becomes a 500: request validation errors are 400, so is a
``RecursionError`` (input nested deeper than the stack), and anything the handlers did not
expect is logged and answered with a 500 in the same shape, since that is our bug, not the
client's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshnode.errors import MeshnodeError

log = logging.getLogger(__name__)

#: Seconds a client is told to wait while the mesh (re)loads. Loading a stage of a small
#: model takes a few seconds; clients that honour ``Retry-After`` then retry promptly.
DEFAULT_RETRY_AFTER_S = 5


class APIError(MeshnodeError):
    """An error the API reports to the client with an OpenAI-shaped body."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        """Extra response headers (none by default)."""
        return {}


class BadRequestError(APIError):
    """The request is well formed but asks for something this server refuses (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(APIError):
    """The ``model`` field names a model this node does not serve (404)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str):
        super().__init__(
            f"The model '{model}' does not exist or is not served here.",
            param="model",
            code="model_not_found",
        )


class ContextLengthError(APIError):
    """The prompt alone needs more positions than the context holds (400, as OpenAI's own
    API answers it, so the official clients raise ``BadRequestError`` with this code)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, prompt_tokens: int, context_size: int, *, pool_tokens: int = 0):
        """``pool_tokens``: the prompt fits, but the prompt and its reply
        (``prompt_tokens`` positions) need more KV than the stages' pools ever hold."""
        message = (
            f"This model's maximum context length is {context_size} tokens, but the prompt "
            f"has {prompt_tokens} tokens (at least one position must remain for the reply)."
        )
        if pool_tokens:
            message = (
                f"The prompt and reply need KV for {prompt_tokens} tokens, but the KV pool "
                f"holds {pool_tokens} for one request; lower max_tokens."
            )
        super().__init__(message, param="messages", code="context_length_exceeded")


class ServiceUnavailableError(APIError):
    """The mesh is loading or the server is saturated; retry later (503)."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = DEFAULT_RETRY_AFTER_S):
        super().__init__(message, code="service_unavailable")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body OpenAI uses for errors."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    """The response for an :class:`APIError`."""
    body = error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers())


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the offending parameter.

    For a value that fits no member of a union (content as text or parts), pydantic reports
    one error per member; the one that got deepest into the value says what is wrong (a
    part's ``type``), so it is chosen. The members' names (``str``, ``list[TextPart]``)
    are left out of the path.
    """
    if not errors:
        return "Invalid request body.", None
    first = max(errors, key=lambda e: len(_path(e)))  # max keeps the first of the deepest
    # The path is ("messages", 0, "content"): its first key is the param.
    loc = _path(first)
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return f"{where}: {first.get('msg', 'invalid value')}", param


def _path(error: Mapping[str, Any]) -> list[str]:
    return [
        str(part)
        for part in error.get("loc", ())
        if part != "body" and not (isinstance(part, str) and _UNION_MEMBER.search(part))
    ]


#: What tells a union member's name in pydantic's error path from a field name: brackets
#: (``list[TextPart]``, ``function-after[...]``) or a plain type name.
_UNION_MEMBER = re.compile(r"[\[\]()]|^(str|int|float|bool|dict|list|none)$")


async def _on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    if param is None and not _is_json(request.headers.get("content-type", "")):
        # FastAPI parses a body as JSON only when it is labelled so (curl -d sends
        # application/x-www-form-urlencoded); pydantic then reports "valid dictionary".
        message = _NOT_JSON.format(request.headers["content-type"])
    body = error_body(message, "invalid_request_error", param=param, code="invalid_request")
    return JSONResponse(body, status_code=400)


_NOT_JSON = (
    "The request body must be a JSON object sent with 'Content-Type: application/json' "
    "(this one was sent as '{}')."
)


def _is_json(content_type: str) -> bool:
    # As FastAPI decides: no header, application/json (with parameters), or a +json type.
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    # Starlette raises these for unknown routes (404) and wrong methods (405).
    assert isinstance(exc, StarletteHTTPException)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = error_body(str(exc.detail), error_type, code=None)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _on_recursion_error(_request: Request, exc: Exception) -> JSONResponse:
    # Only input nested deeper than the stack reaches this (a JSON body or a value in it
    # thousands of levels deep, issue 36, item 11): the client's doing, so a 400.
    assert isinstance(exc, RecursionError)
    message = "The request nests arrays or objects too deeply to be read."
    body = error_body(message, "invalid_request_error", code="invalid_request")
    return JSONResponse(body, status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the API returns OpenAI-shaped (see the module docstring)."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RecursionError, _on_recursion_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
