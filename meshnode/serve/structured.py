"""Structured output: ``response_format`` and forced tool calls as grammars.

A request that must produce JSON (``response_format`` ``json_object`` or ``json_schema``)
or a tool call (``tool_choice`` ``required`` or a named function) is compiled here, on the
host, into llguidance's serialized grammar. The grammar travels with the request's first
frame to the last stage, which enforces it on every token it chooses
(:mod:`meshnode.engine.constraint`). A schema or grammar llguidance cannot compile is a 400
naming the parameter, before anything is admitted.

JSON is generated compactly but readably (``", "`` and ``": "`` between items, no other
whitespace): small models given free whitespace tend to emit newlines until their token
budget runs out. A forced call is written in the model's own tool format, with the call's
JSON constrained to ``{"name": <one of the tools>, "<arguments key>": <its parameters>}``,
name first (so that streaming can hand out the name before the arguments):

- ``hermes``: ``<tool_call>\\n{…}\\n</tool_call>``, repeated on new lines when parallel
  calls are allowed;
- ``llama3_json``: ``{…}``, separated by ``"; "``;
- ``mistral``: ``[TOOL_CALLS][{…}, …]`` (the marker as its special token when the
  vocabulary has one).

A forced tool call wins over ``response_format``: the reply is the call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from meshnode.engine.constraint import validate_grammar
from meshnode.serve.errors import BadRequestError
from meshnode.serve.toolparse import ARGUMENT_KEYS, START_MARKERS, ToolFormat
from meshnode.serve.tools import ToolPlan, ToolSpec

__all__ = ["MAX_GRAMMAR_BYTES", "request_grammar"]

#: Largest compiled grammar a request may carry. It travels in the CBOR header of the
#: request's first frame, which the wire protocol caps at 64 KiB (``MAX_HEADER_BYTES``);
#: half of that leaves room for the frame's other fields. A schema this large is far beyond
#: what structured-output users send (OpenAI's own limits are of the same order).
MAX_GRAMMAR_BYTES = 32 * 1024
#: How generated JSON is laid out (module docstring); llguidance's JSON compile options.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
#: The glue between two forced calls, per format, when parallel calls are allowed.
_CALL_SEPARATORS = {
    ToolFormat.HERMES: "\\n",  # a Lark escape: a newline
    ToolFormat.LLAMA3_JSON: "; ",
    ToolFormat.MISTRAL: ", ",
}

#: Looks up the id of a special token by its text (None: not a special token).
SpecialTokenId = Callable[[str], "int | None"]


def request_grammar(
    response_format: Mapping[str, Any] | None, tools: ToolPlan, special_id: SpecialTokenId
) -> str | None:
    """The grammar a chat request's reply must follow, or None for free text.

    Raises BadRequestError (param ``response_format`` or ``tools``) for a malformed format,
    a schema llguidance cannot compile, or a grammar over :data:`MAX_GRAMMAR_BYTES`.
    """
    if tools.forced:
        return _checked(_tool_grammar(tools, special_id), "tools")
    schema = _response_schema(response_format)
    if schema is None:
        return None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except ValueError as exc:
        raise BadRequestError(f"Invalid JSON schema: {exc}", param="response_format") from exc
    return _checked(grammar, "response_format")


def _response_schema(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    kind = None if response_format is None else response_format.get("type")
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise BadRequestError(
            "response_format.type must be 'text', 'json_object' or 'json_schema'.",
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise BadRequestError(
            "response_format.json_schema must be an object with a 'schema'.",
            param="response_format",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, Mapping):
        raise BadRequestError(
            "response_format.json_schema.schema must be a JSON schema object.",
            param="response_format",
        )
    return dict(schema)


def _checked(grammar: str, param: str) -> str:
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise BadRequestError(
            f"The schema compiles to a grammar over {MAX_GRAMMAR_BYTES} bytes.", param=param
        )
    problem = validate_grammar(grammar)
    if problem is not None:
        raise BadRequestError(f"Invalid JSON schema: {problem}", param=param)
    return grammar


# -- forced tool calls ---------------------------------------------------------------------


def _tool_grammar(tools: ToolPlan, special_id: SpecialTokenId) -> str:
    fmt = tools.format
    schema = _calls_schema(tools.forced, ARGUMENT_KEYS[fmt])
    more = f' ("{_CALL_SEPARATORS[fmt]}" call)*' if tools.parallel else ""
    if fmt is ToolFormat.HERMES:
        call = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'
        start = f"call{more}"
    elif fmt is ToolFormat.LLAMA3_JSON:
        call, start = f"%json {schema}", f"call{more}"
    else:
        call = f"%json {schema}"
        start = f'{_marker(START_MARKERS[fmt], special_id)} "[" call{more} "]"'
    return llguidance.LLMatcher.grammar_from_lark(
        f"%llguidance {{}}\nstart: {start}\ncall: {call}\n"
    )


def _calls_schema(specs: tuple[ToolSpec, ...], arguments_key: str) -> str:
    """A JSON schema for one call of any of ``specs``, as compact JSON for the grammar."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": s.name}, arguments_key: dict(s.parameters)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for s in specs
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT}, separators=(",", ":"))


def _marker(text: str, special_id: SpecialTokenId) -> str:
    """A marker in Lark: its special token (``<[id]>``) where the vocabulary has one, else
    its text."""
    token = special_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)
