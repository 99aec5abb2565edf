"""Request and response models of the Anthropic Messages API (``POST /v1/messages``).

The same leniency as the OpenAI schemas (:mod:`meshnode.serve.schemas`): unknown fields
are ignored and logged once (the SDK sends ``metadata``, ``service_tier``, ``thinking``
and the like), known fields are strict and a bad value is a 400 naming it. Anthropic's own
limits hold: ``max_tokens`` is required, ``temperature`` is within 0..1.

Content is a string or a list of blocks: ``text`` blocks are read,
``thinking``/``redacted_thinking`` blocks (which clients send back unchanged) are dropped,
``tool_use`` (assistant) and ``tool_result`` (user) blocks carry tool calls and their
results (:mod:`meshnode.serve.anthropic_tools`). Images and documents are refused with a
400 naming the block type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from meshnode.serve.anthropic_tools import block_text
from meshnode.serve.errors import BadRequestError
from meshnode.serve.schemas import PositiveInt, RequestModel, Text

__all__ = ["MessagesRequest"]
#: Stop sequences a request may carry; each is scanned at every committed token (OpenAI
#: allows 4; Anthropic documents no limit, so this is a bound of ours, not theirs).
MAX_STOP_SEQUENCES = 16


class ContentBlock(RequestModel):
    type: StrictStr
    text: Text | None = None
    # tool_use (an assistant's call)
    id: Text | None = None
    name: Text | None = None
    input: dict[str, Any] | None = None
    # tool_result (the user's answer to a call)
    tool_use_id: Text | None = None
    content: Text | list[ContentBlock] | None = None
    is_error: StrictBool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The block as :func:`meshnode.serve.anthropic_tools.chat_turns` reads it."""
        return self.model_dump(exclude_none=True)


Content = Text | list[ContentBlock]


def content_text(content: Content, where: str) -> str:
    """The system prompt's content as one string (text blocks joined)."""
    if isinstance(content, str):
        return content
    return "".join(block_text(b.as_dict(), f"{where}.{i}", "text") for i, b in enumerate(content))


def history(messages: list[InputMessage]) -> list[tuple[str, Any]]:
    """The messages as :func:`meshnode.serve.anthropic_tools.chat_turns` reads them."""
    return [
        (m.role, m.content if isinstance(m.content, str) else [b.as_dict() for b in m.content])
        for m in messages
    ]


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: Content


class OutputConfig(RequestModel):
    format: dict[str, Any] | None = None  # ``effort`` and the like are ignored


class MessagesRequest(RequestModel):
    model: StrictStr
    max_tokens: PositiveInt
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Content | None = None
    stop_sequences: list[Text] | None = None
    stream: StrictBool = False
    cache_prompt: StrictBool = True  # llama-server's: false opts out of the prefix cache
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the beta's name for output_config.format

    def check_supported(self) -> None:
        """Raise BadRequestError for what this server does not implement here."""
        if len(self.stop_sequences or ()) > MAX_STOP_SEQUENCES:
            raise BadRequestError(
                f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.",
                param="stop_sequences",
            )

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling settings the request gave (omitted ones are left to the model)."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return {name: value for name, value in given.items() if value is not None}

    def stops(self) -> tuple[str, ...]:
        """The non-empty stop sequences."""
        return tuple(s for s in self.stop_sequences or () if s)

    def response_format(self) -> dict[str, Any] | None:
        """Anthropic's structured output (``output_config.format``, or the beta's
        ``output_format``) as the OpenAI ``response_format`` that
        :func:`meshnode.serve.structured.request_grammar` compiles; None for free text.
        Raises BadRequestError for a format that is not ``{"type": "json_schema",
        "schema": {...}}``."""
        fmt, where = self.output_format, "output_format"
        if self.output_config is not None and self.output_config.format is not None:
            fmt, where = self.output_config.format, "output_config.format"
        if fmt is None:
            return None
        schema = fmt.get("schema")
        if fmt.get("type") != "json_schema" or not isinstance(schema, dict):
            raise BadRequestError(
                f'{where} must be {{"type": "json_schema", "schema": {{...}}}}.', param=where
            )
        return {"type": "json_schema", "json_schema": {"schema": schema}}


class CountTokensRequest(RequestModel):
    model: StrictStr
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Content | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


# -- responses --------------------------------------------------------------------------


StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    input_tokens: int  # not read from the cache, as Anthropic counts them
    output_tokens: int
    cache_read_input_tokens: int = 0  # resumed from the stages' prefix cache


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    meshnode: dict[str, Any] | None = None
