"""Tool calls on the way out: a chat reply's text split into content and ``tool_calls``.

:class:`ReplyShaper` feeds the reply's text through the request's
:class:`~meshnode.serve.toolparse.ToolCallStream` (or passes it through when the request
parses no calls) and says what each streamed chunk carries. The non-streamed message is
the same shaper fed every delta at once, so a stream's pieces always reassemble to the
non-streamed reply. A reply that made calls and ended by itself finishes with
``tool_calls``, as OpenAI's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnode.serve import schemas as s
from meshnode.serve.toolparse import CallDelta, ToolCallStream, ToolDelta

__all__ = ["ReplyShaper"]


@dataclass(slots=True)
class ReplyShaper:
    """Turns the text deltas of one chat reply into OpenAI's message or chunk deltas."""

    parser: ToolCallStream | None
    _content: list[str] = field(default_factory=list)

    def push(
        self, text: str, finish_reason: str | None
    ) -> tuple[s.ChatDelta | None, str | None]:
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
            return "tool_calls"
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
