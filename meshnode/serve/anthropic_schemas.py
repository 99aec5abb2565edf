"""Request and response models of the Anthropic Messages API (``POST /v1/messages``).

The same leniency as the OpenAI schemas (:mod:`meshnode.serve.schemas`): unknown fields
are ignored and logged once (the SDK sends ``metadata``, ``service_tier``, ``thinking``
and the like), known fields are strict and a bad value is a 400 naming it. Anthropic's own
limits hold: ``max_tokens`` is required, ``temperature`` is within 0..1.

Content is text: a string, or a list of blocks of which ``text`` blocks are read and
``thinking``/``redacted_thinking`` blocks (which clients send back unchanged) are dropped.
Images, documents and tool blocks are refused with a 400 naming the block type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from meshnode.serve.errors import BadRequestError
from meshnode.serve.schemas import PositiveInt, RequestModel, Text

__all__ = ["MessagesRequest"]

#: Blocks the model never reads: its own reasoning, which clients echo back in history.
IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
#: Stop sequences a request may carry; each is scanned at every committed token (OpenAI
#: allows 4; Anthropic documents no limit, so this is a bound of ours, not theirs).
MAX_STOP_SEQUENCES = 16


class ContentBlock(RequestModel):
    type: StrictStr
    text: Text | None = None

    def text_of(self, where: str) -> str:
        """The block's text ('' for a dropped block); BadRequestError for other types."""
        if self.type == "text" and self.text is not None:
            return self.text
        if self.type in IGNORED_BLOCKS:
            return ""
        raise BadRequestError(
            f"{where}: content blocks of type {self.type!r} are not supported "
            "(only text).",
            param=where,
            code="unsupported",
        )


Content = Text | list[ContentBlock]


def content_text(content: Content, where: str) -> str:
    """A message's or system prompt's content as one string (text blocks joined)."""
    if isinstance(content, str):
        return content
    return "".join(block.text_of(where) for block in content)


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: Content


class MessagesRequest(RequestModel):
    model: StrictStr
    max_tokens: PositiveInt
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Content | None = None
    stop_sequences: list[Text] | None = None
    stream: StrictBool = False
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raise BadRequestError for what this server does not implement here."""
        if self.tools:
            raise BadRequestError(
                "Tools are not supported on /v1/messages yet.", param="tools", code="unsupported"
            )
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


class CountTokensRequest(RequestModel):
    model: StrictStr
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Content | None = None
    tools: list[dict[str, Any]] | None = None


# -- responses --------------------------------------------------------------------------


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "model_context_window_exceeded"]


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    meshnode: dict[str, Any] | None = None
