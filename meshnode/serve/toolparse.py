"""Tool calls in a model's output: the three common formats, parsed as text streams in.

Which format a model writes is a property of its chat template (see
:func:`meshnode.serve.tools.tool_format`):

- ``hermes`` (Hermes, Qwen 2/2.5/3, and every template without tool support, which gets
  our fallback prompt): ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, one
  block per call, after any text.
- ``llama3_json`` (Llama 3.1+): the message is JSON, ``{"name": …, "parameters": {…}}``,
  several calls separated by ``;``, optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``.

The markers ``<|python_tag|>`` and ``[TOOL_CALLS]`` are special tokens, which the
detokenizer drops, so for those two formats a reply that *starts* with ``{`` or ``[`` is
read as calls too (as vLLM's parsers do).

Theory of operation. :class:`ToolCallStream` takes the reply's text piece by piece. Before
the format's start marker it is plain content, except a tail that could be the start of the
marker, which is held back (as stop strings are). After the marker, the text is the *call
region*: every top-level JSON object in it is one call, whatever glue sits between them
(``</tool_call><tool_call>``, ``, ``, ``;``). Each push re-reads the region and hands out
what is new: a call's id and name once its name is complete, then the characters of its
arguments object as they arrive (OpenAI's streaming shape). The non-streamed reply is the
same stream's final state, so streamed deltas always reassemble to it. A region that never
yields a call is given back as content at the end.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from dataclasses import dataclass, field

__all__ = ["CallDelta", "ParsedCall", "ToolCallStream", "ToolDelta", "ToolFormat", "new_call_id"]


class ToolFormat(enum.StrEnum):
    """How a model writes tool calls (module docstring)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


#: The text that opens the call region, per format. See also :data:`BARE_OPENERS`.
START_MARKERS: dict[ToolFormat, str] = {
    ToolFormat.HERMES: "<tool_call>",
    ToolFormat.LLAMA3_JSON: "<|python_tag|>",
    ToolFormat.MISTRAL: "[TOOL_CALLS]",
}
#: What a reply that *is* calls starts with, where the format's marker is a special token
#: that the detokenizer drops (Llama 3's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) or
#: that the template leaves out: the region then opens at the reply's first character.
BARE_OPENERS: dict[ToolFormat, str] = {ToolFormat.LLAMA3_JSON: "{", ToolFormat.MISTRAL: "["}
#: The key that holds a call's arguments in each format.
ARGUMENT_KEYS: dict[ToolFormat, str] = {
    ToolFormat.HERMES: "arguments",
    ToolFormat.LLAMA3_JSON: "parameters",
    ToolFormat.MISTRAL: "arguments",
}

#: The head of a call object written name first: ``{"name": "…", "arguments": ``. A call
#: whose keys come in another order is handed out whole, once its object is complete.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    """A fresh tool call id in OpenAI's shape (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call of a finished reply; ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    """What one push adds to call ``index``: its id and name the first time, then more
    characters of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """What one push adds to the reply: content text and call pieces."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class _Object:
    """A top-level JSON object of the call region, maybe still open."""

    text: str
    complete: bool


@dataclass(slots=True)
class ToolCallStream:
    """Splits a reply into content and tool calls as it streams (module docstring)."""

    format: ToolFormat
    #: At most one call (``parallel_tool_calls: false``): calls after the first are
    #: dropped, as OpenAI's model makes at most one then.
    single: bool = False
    calls: list[_Call] = field(default_factory=list)
    _pending: str = ""  # content held back: it may be the start of the marker
    _region: str | None = None  # the text after the marker, once it was seen
    _content_seen: bool = False  # whether anything but whitespace came before
    # The marker that opened the region ("" for Llama 3's bare JSON), with the whitespace
    # before it: given back with the region if no call comes of it.
    _marker: str = ""

    @property
    def parsed(self) -> list[ParsedCall]:
        """The calls so far (all of them once :meth:`finish` ran)."""
        return [ParsedCall(c.id, c.name, c.arguments) for c in self.calls]

    def push(self, text: str) -> ToolDelta:
        """Take the next piece of the reply; returns what the client may see now."""
        if self._region is not None:
            self._region += text
            return ToolDelta(calls=self._scan(final=False))
        self._pending += text
        return self._split_content()

    def finish(self) -> ToolDelta:
        """The end of the reply: held-back text, the last calls, or an unusable region
        given back as content."""
        if self._region is None:
            content, self._pending = self._pending, ""
            return ToolDelta(content=content)
        deltas = self._scan(final=True)
        if not self.calls:
            content, self._region = self._marker + self._region, ""
            return ToolDelta(content=content)
        return ToolDelta(calls=deltas)

    # -- content before the region ----------------------------------------------------

    def _split_content(self) -> ToolDelta:
        marker = START_MARKERS[self.format]
        at = self._pending.find(marker)
        if at < 0 and self._opens_with_json():
            at, marker = len(self._pending) - len(self._pending.lstrip()), ""
        if at >= 0:
            # Whitespace between the text and the calls is layout, not content.
            content = self._pending[:at].rstrip()
            self._marker = self._pending[len(content) : at] + marker
            self._region = self._pending[at + len(marker) :]
            self._pending = ""
            return ToolDelta(content=content, calls=self._scan(final=False))
        # Held back: a tail that may start the marker, and whitespace that may precede it.
        keep = _held_back(self._pending, marker)
        text = self._pending[: len(self._pending) - keep]
        keep += len(text) - len(text.rstrip())
        if self.format in BARE_OPENERS and not self._content_seen:
            if not self._pending.strip():
                return ToolDelta()  # leading whitespace: the reply may still open with "{"
            self._content_seen = True
        cut = len(self._pending) - keep
        content, self._pending = self._pending[:cut], self._pending[cut:]
        return ToolDelta(content=content)

    def _opens_with_json(self) -> bool:
        opener = BARE_OPENERS.get(self.format)
        return (
            opener is not None
            and not self._content_seen
            and self._pending.lstrip().startswith(opener)
        )

    # -- the call region ------------------------------------------------------------------

    def _scan(self, *, final: bool) -> tuple[CallDelta, ...]:
        assert self._region is not None
        out: list[CallDelta] = []
        objects = _objects(self._region)
        for index, obj in enumerate(objects[:1] if self.single else objects):
            delta = self._advance(index, obj, final)
            if delta is None:
                break  # calls are handed out in order: a later one waits for this one
            if delta.id is not None or delta.arguments:
                out.append(delta)
        return tuple(out)

    def _advance(self, index: int, obj: _Object, final: bool) -> CallDelta | None:
        """What call ``index`` adds now; None while its name is not known."""
        head = _HEAD.match(obj.text)
        if index == len(self.calls):
            name = _name(obj, head)
            if name is None:
                return None
            self.calls.append(_Call(new_call_id(), name))
            call, opened = self.calls[index], True
        else:
            call, opened = self.calls[index], False
        arguments = _arguments(obj, head, self.format, final)
        if arguments is None:
            arguments = call.arguments  # not readable yet: nothing new
        new = arguments[len(call.arguments) :] if arguments.startswith(call.arguments) else ""
        call.arguments += new
        if opened:
            return CallDelta(index, call.id, call.name, new)
        return CallDelta(index, arguments=new)


def _name(obj: _Object, head: re.Match[str] | None) -> str | None:
    if head is not None:
        name = json.loads(f'"{head.group(1)}"')
        return name if isinstance(name, str) else None
    if not obj.complete:
        return None
    value = _load(obj.text)
    name = value.get("name") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


def _arguments(
    obj: _Object, head: re.Match[str] | None, fmt: ToolFormat, final: bool
) -> str | None:
    """The arguments' JSON text so far: streamed when the object is written name first and
    its arguments are an object, else whole once the call's object is complete."""
    if head is not None:
        rest = obj.text[head.end() :]
        if rest.startswith("{"):
            return rest[: _value_end(rest)[0]]
    if not (obj.complete or final):
        return None
    value = _load(obj.text)
    if not isinstance(value, dict):
        return None
    args = value.get(ARGUMENT_KEYS[fmt], value.get("arguments", value.get("parameters", {})))
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _load(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _objects(region: str) -> list[_Object]:
    """The top-level JSON objects of ``region``, the last one maybe still open."""
    out: list[_Object] = []
    at = region.find("{")
    while at >= 0:
        length, complete = _value_end(region[at:])
        out.append(_Object(region[at : at + length], complete))
        if not complete:
            break
        at = region.find("{", at + length)
    return out


def _value_end(text: str) -> tuple[int, bool]:
    """The length of the JSON object or array that opens ``text``, and whether it is closed
    (if not, the length is all of ``text``): a scan of nesting that skips brackets inside
    strings."""
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return len(text), False


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
