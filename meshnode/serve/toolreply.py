"""Tool calls on the way out: a chat reply's text split into content and ``tool_calls``.

:class:`ReplyShaper` feeds the reply's text through the request's
:class:`~meshnode.serve.toolparse.ToolCallStream` (or passes it through when the request
parses no calls) and says what each streamed chunk carries. The non-streamed message is
the same shaper fed every delta at once, so a stream's pieces always reassemble to the
non-streamed reply. A reply that made calls and ended by itself finishes with
``calls_finish_reason``: ``tool_calls``, or ``stop`` for a named ``tool_choice``, as
OpenAI's does (:attr:`meshnode.serve.tools.ToolPlan.calls_finish_reason`).

:class:`BlockStream` cuts the same parser's output into content blocks instead, for the
APIs that answer in blocks or items (Anthropic's Messages, OpenAI's Responses): text into
a ``text`` block, each call into a ``tool_use`` block opened with its id and name whose
arguments arrive as ``input_json_delta`` pieces, with the stream events of each (in
Anthropic's names: ``content_block_start``, ``content_block_delta``,
``content_block_stop``). The whole reply's blocks are the same stream's, so the two agree.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshnode.generation.state import Delta
from meshnode.serve import schemas as s
from meshnode.serve.toolparse import CallDelta, ToolCallStream, ToolDelta

__all__ = [
    "BlockStream",
    "Event",
    "EventSource",
    "ReplyShaper",
    "feed_reply",
    "reply_events",
    "tool_use_id",
]

#: One stream event: its name and its payload (without ``type``, which is the name).
Event = tuple[str, dict[str, Any]]


class EventSource(Protocol):
    """What turns a reply's text into stream events: :class:`BlockStream`, or the Responses
    API's items over one."""

    def start(self) -> list[Event]:
        """The events that open the reply."""
        ...

    def push(self, text: str, final: bool) -> list[Event]:
        """The events for the next piece of the reply (``final``: and those that end it)."""
        ...


def feed_reply(source: EventSource, deltas: Sequence[Delta]) -> None:
    """Feed a whole (not streamed) reply's ``deltas`` to ``source``, the last as final (an
    empty reply as one empty final piece); what it built is read from ``source``."""
    source.start()
    for i, delta in enumerate(deltas):
        source.push(delta.text, final=i == len(deltas) - 1)
    if not deltas:
        source.push("", final=True)


async def reply_events(
    deltas: AsyncGenerator[Delta, None], source: EventSource
) -> AsyncGenerator[Event, None]:
    """The events of a reply streamed as ``deltas`` (closed when this ends): each delta's
    text pushed through ``source``, the last as final; a stream that stops without a finish
    reason still gets its final (empty) piece. Raises what ``deltas`` raises."""
    ended = False
    async with aclosing(deltas):
        async for delta in deltas:
            ended = delta.finish_reason is not None
            for event in source.push(delta.text, final=ended):
                yield event
    if not ended:
        for event in source.push("", final=True):
            yield event


@dataclass(slots=True)
class ReplyShaper:
    """Turns the text deltas of one chat reply into OpenAI's message or chunk deltas."""

    parser: ToolCallStream | None
    calls_finish_reason: str = "tool_calls"
    _content: list[str] = field(default_factory=list)

    def push(self, text: str, finish_reason: str | None) -> tuple[s.ChatDelta | None, str | None]:
        """The chunk delta for the next piece of text (None if it shows nothing yet) and
        the finish reason to report with it (None until the last piece)."""
        if self.parser is None:
            self._content.append(text)
            return (s.ChatDelta(content=text) if text else None), finish_reason
        piece = self.parser.push(text)
        if finish_reason is not None:
            end = self.parser.finish()
            piece = ToolDelta(piece.content + end.content, piece.calls + end.calls)
        self._content.append(piece.content)
        return _chunk_delta(piece), self._finish_reason(finish_reason)

    def message(
        self, texts: list[str], finish_reason: str | None
    ) -> tuple[s.AssistantMessage, str | None]:
        """The whole reply as one message, from every delta's text; and its finish reason."""
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            self.push(text, finish_reason if last else None)
        if not texts:
            self.push("", finish_reason)
        content = "".join(self._content)
        calls = None if self.parser is None else self.parser.parsed
        if not calls:
            return s.AssistantMessage(content=content), finish_reason
        tool_calls = [
            s.ResponseToolCall(id=c.id, function=s.FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        message = s.AssistantMessage(content=content or None, tool_calls=tool_calls)
        return message, self._finish_reason(finish_reason)

    def _finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.parser is not None and self.parser.calls:
            return self.calls_finish_reason
        return reason


def _chunk_delta(piece: ToolDelta) -> s.ChatDelta | None:
    if not piece:
        return None
    calls = [_call_delta(c) for c in piece.calls] or None
    return s.ChatDelta(content=piece.content or None, tool_calls=calls)


def _call_delta(delta: CallDelta) -> s.ToolCallDelta:
    return s.ToolCallDelta(
        index=delta.index,
        id=delta.id,
        type="function" if delta.id is not None else None,
        function=s.FunctionCallDelta(name=delta.name, arguments=delta.arguments),
    )


# -- content blocks -------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a call (``toolu_`` and the call's random part)."""
    return "toolu_" + call_id.removeprefix("call_")


@dataclass(slots=True)
class BlockStream:
    """A reply's content blocks, built from its text as it streams (module docstring).

    Without a parser (no tools shown) the reply is one text block, opened at once as
    Anthropic's stream opens it; with one, blocks open as text or calls arrive, and a reply
    that has neither gets an empty text block, as the non-streamed message does."""

    parser: ToolCallStream | None
    #: The blocks so far, as Anthropic writes them; a tool_use block's ``input`` is the
    #: JSON text of its arguments until :meth:`blocks` parses it.
    _blocks: list[dict[str, Any]] = field(default_factory=list)
    _open: bool = False  # whether the last block is still open
    _call_blocks: dict[int, int] = field(default_factory=dict)  # call index → block index

    def start(self) -> list[Event]:
        """The events that open the reply (its text block, when no tools are shown)."""
        return self._open_block({"type": "text", "text": ""}) if self.parser is None else []

    def push(self, text: str, final: bool) -> list[Event]:
        """The events for the next piece of the reply; with ``final`` also those that end
        it (the parser's held-back text and last calls, and the last block's stop)."""
        piece = ToolDelta(content=text)
        if self.parser is not None:
            piece = self.parser.push(text)
            if final:
                end = self.parser.finish()
                piece = ToolDelta(piece.content + end.content, piece.calls + end.calls)
        events = self._text(piece.content) if piece.content else []
        for call in piece.calls:
            events += self._call(call)
        if final:
            if not self._blocks:
                events += self._open_block({"type": "text", "text": ""})
            events += self._close()
        return events

    @property
    def made_calls(self) -> bool:
        """Whether the reply called a tool."""
        return bool(self._call_blocks)

    def blocks(self) -> list[dict[str, Any]]:
        """The content blocks of the whole reply (once the final piece was pushed)."""
        return [_finished(block) for block in self._blocks]

    def block(self, index: int) -> dict[str, Any]:
        """Block ``index`` so far, a tool_use block's ``input`` as the JSON text of its
        arguments (as they streamed)."""
        return dict(self._blocks[index])

    def _text(self, text: str) -> list[Event]:
        events = []
        if not (self._open and self._blocks[-1]["type"] == "text"):
            events = self._close() + self._open_block({"type": "text", "text": ""})
        self._blocks[-1]["text"] += text
        return [*events, _delta(len(self._blocks) - 1, {"type": "text_delta", "text": text})]

    def _call(self, call: CallDelta) -> list[Event]:
        events: list[Event] = []
        if call.id is not None:
            block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": ""}
            events = self._close() + self._open_block(block)
            self._call_blocks[call.index] = len(self._blocks) - 1
        if not call.arguments:
            return events
        index = self._call_blocks[call.index]
        self._blocks[index]["input"] += call.arguments
        piece = {"type": "input_json_delta", "partial_json": call.arguments}
        return [*events, _delta(index, piece)]

    def _open_block(self, block: dict[str, Any]) -> list[Event]:
        self._blocks.append(block)
        self._open = True
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [("content_block_start", {"index": len(self._blocks) - 1, "content_block": shown})]

    def _close(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        return [("content_block_stop", {"index": len(self._blocks) - 1})]


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"index": index, "delta": delta}


def _finished(block: dict[str, Any]) -> dict[str, Any]:
    if block["type"] != "tool_use":
        return dict(block)
    return {**block, "input": _object(block["input"])}


def _object(text: str) -> dict[str, Any]:
    """A call's arguments as an object; ``{}`` for arguments that are not a JSON object
    (a call cut off by ``max_tokens``, which the stop reason says)."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
