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

**Other servers' fields** (:func:`request_grammar`'s ``others``), so that clients written
for them constrain output here too, on chat and text completions alike: vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and
its older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``, and
llama-server's ``json_schema`` and ``grammar``. A grammar is Lark (llguidance's dialect)
or GBNF (llama.cpp's), told apart by llguidance. A request gives at most one constraint
(``response_format`` counting as one); two are a 400 naming both.
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

__all__ = ["MAX_GRAMMAR_BYTES", "OTHER_FIELDS", "request_grammar"]

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


#: Each other server's field (module docstring), as the kind of constraint it gives.
OTHER_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json",  # llama-server
    "grammar": "grammar",  # llama-server
}
#: The kinds of vLLM's ``structured_outputs`` object (its other keys tune vLLM's backends).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def request_grammar(
    response_format: Mapping[str, Any] | None,
    tools: ToolPlan,
    special_id: SpecialTokenId,
    others: Mapping[str, Any] | None = None,
) -> str | None:
    """The grammar a request's reply must follow, or None for free text. ``others`` are
    the request's fields of :data:`OTHER_FIELDS` and ``structured_outputs`` (absent or
    None: not given).

    Raises BadRequestError (naming the parameter) for a malformed format, two constraints
    at once, a schema or grammar llguidance cannot compile, or a grammar over
    :data:`MAX_GRAMMAR_BYTES`.
    """
    if tools.forced:
        return _checked(_tool_grammar(tools, special_id), "tools")
    schema = _response_schema(response_format)
    given = _other_constraints(others or {})
    if schema is not None:
        given.insert(0, ("response_format", "json", schema))
    if len(given) > 1:
        names = " and ".join(param for param, _, _ in given[:2])
        raise BadRequestError(f"Give one output constraint, not {names}.", param=given[1][0])
    if not given:
        return None
    param, kind, value = given[0]
    return _checked(_compile(param, kind, value), param)


def _other_constraints(others: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    given = [(f, OTHER_FIELDS[f], v) for f, v in others.items() if f in OTHER_FIELDS]
    given = [item for item in given if item[2] is not None]
    structured = others.get("structured_outputs")
    if structured is not None:
        given += [
            (f"structured_outputs.{kind}", kind, structured[kind])
            for kind in STRUCTURED_OUTPUT_KINDS
            if structured.get(kind) not in (None, False)
        ]
    return given


def _compile(param: str, kind: str, value: Any) -> str:
    """llguidance's grammar for one constraint; BadRequestError naming ``param``."""
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else _schema(param, value)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
        if kind == "choice":
            if not value or not all(isinstance(c, str) for c in value):
                raise BadRequestError(f"{param} must be a non-empty list of strings.", param=param)
            return llguidance.grammar_from("choice", json.dumps(value))
        if not isinstance(value, str):
            raise BadRequestError(f"{param} must be a string.", param=param)
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
    except ValueError as exc:
        raise BadRequestError(f"{param} does not compile: {exc}", param=param) from exc


def _schema(param: str, value: Any) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRequestError(f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, Mapping):
        raise BadRequestError(f"{param} must be a JSON schema object.", param=param)
    return dict(value)


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
        what = "JSON schema" if param in ("response_format", "tools") else "grammar"
        raise BadRequestError(f"Invalid {what}: {problem}", param=param)
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
