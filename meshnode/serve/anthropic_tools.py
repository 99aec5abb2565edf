"""Tools on the Anthropic Messages API, mapped onto the machinery of the OpenAI routes.

On the way in, Anthropic's ``tools`` (``{"name", "description", "input_schema"}``) become
:class:`~meshnode.serve.tools.ToolSpec` records and ``tool_choice`` a
:class:`~meshnode.serve.tools.ToolChoice`: ``auto`` → ``auto``, ``any`` → ``required``,
``tool`` → the named function, ``none`` → ``none``, and ``disable_parallel_tool_use`` allows
one call. So the prompt shows them as a chat completion's does (the model's template, or
the Hermes fallback), and a forced choice is enforced by the same grammar
(:mod:`meshnode.serve.structured`). Anthropic's own tool types (``web_search_…``,
``bash_…``, ``text_editor_…``, ``computer_…``) run on Anthropic's servers and are a 400.

History becomes the chat turns templates read (:func:`chat_turns`): an assistant's
``tool_use`` blocks are its ``tool_calls`` (``input`` as JSON arguments), and a user's
``tool_result`` blocks are ``tool`` turns with ``tool_call_id`` and the called tool's name,
ahead of the user's text, in the order Anthropic requires them. A result sent with
``is_error`` reads ``Error: …``, so the model sees that the call failed.

On the way out, replies are cut into content blocks by
:class:`~meshnode.serve.toolreply.BlockStream`; a reply that made a call and ended by
itself stops with ``tool_use``, forced or not, as Anthropic's API does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from meshnode.serve.errors import BadRequestError
from meshnode.serve.toolparse import ToolFormat
from meshnode.serve.tools import (
    ToolChoice,
    ToolPlan,
    ToolSpec,
    check_tool_count,
    function_spec,
    unique_specs,
)

__all__ = ["anthropic_tool_plan", "block_text", "chat_turns"]

#: The tool types a client defines and runs itself (Anthropic's ``custom``, or no type).
CLIENT_TOOL_TYPES = frozenset({"custom"})
#: Blocks the model never reads: its own reasoning, which clients echo back in history.
IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking"})


# -- requests -------------------------------------------------------------------------------


def anthropic_tool_plan(
    tools: Sequence[Mapping[str, Any]] | None,
    choice: Mapping[str, Any] | None,
    fmt: ToolFormat,
) -> ToolPlan:
    """The plan of a Messages request's ``tools`` and ``tool_choice`` (module docstring);
    raises BadRequestError (param ``tools`` or ``tool_choice``) for a bad one."""
    specs = _specs(tools or ())
    mode, parallel = _choice(choice, specs)
    return ToolPlan(tuple(specs), mode, fmt, parallel)


def _specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    check_tool_count(tools)
    specs = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type")
        if kind is not None and kind not in CLIENT_TOOL_TYPES:
            raise BadRequestError(
                f"{where}: tools of type {kind!r} run on Anthropic's servers; only tools "
                "the client runs (with an input_schema) are supported.",
                param="tools",
                code="unsupported",
            )
        if "input_schema" not in tool:
            raise BadRequestError(f"{where}.input_schema is required.", param="tools")
        name, description, schema = tool.get("name"), tool.get("description"), tool["input_schema"]
        specs.append(function_spec(where, name, description, schema, schema_key="input_schema"))
    return unique_specs(specs)


def _choice(raw: Mapping[str, Any] | None, specs: Sequence[ToolSpec]) -> tuple[ToolChoice, bool]:
    if raw is None:
        return ToolChoice("auto" if specs else "none"), True
    kind = raw.get("type")
    parallel = raw.get("disable_parallel_tool_use") is not True
    if kind == "none" or (kind == "auto" and not specs):
        return ToolChoice("none"), parallel
    if kind not in ("auto", "any", "tool"):
        raise BadRequestError(
            "tool_choice.type must be 'auto', 'any', 'tool' or 'none'.", param="tool_choice"
        )
    if not specs:
        raise BadRequestError(f"tool_choice {kind!r} needs tools.", param="tool_choice")
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    name = raw.get("name")
    if name not in {s.name for s in specs}:
        raise BadRequestError(
            f"tool_choice names {name!r}, which is not a tool.", param="tool_choice"
        )
    return ToolChoice("named", str(name)), parallel


def chat_turns(messages: Sequence[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The chat turns (as :func:`meshnode.serve.tools.render_chat` takes them) of a
    Messages history given as ``(role, content)`` pairs, content a string or a list of
    blocks (each with ``type`` and that type's fields); raises BadRequestError for a block
    this server does not read or one in the wrong turn."""
    names: dict[str, str] = {}  # tool_use id → the tool's name, for the results
    turns: list[dict[str, Any]] = []
    for i, (role, content) in enumerate(messages):
        where = f"messages.{i}.content"
        if isinstance(content, str):
            turns.append({"role": role, "content": content})
        elif role == "assistant":
            turns.append(_assistant_turn(content, where, names))
        else:
            turns.extend(_user_turns(content, where, names))
    return turns


def _assistant_turn(
    blocks: Sequence[Mapping[str, Any]], where: str, names: dict[str, str]
) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "tool_use":
            call = _call(block, f"{where}.{j}")
            names[call["id"]] = call["function"]["name"]
            calls.append(call)
        else:
            text.append(block_text(block, f"{where}.{j}", "text"))
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    ident, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(ident, str) or not isinstance(name, str):
        raise BadRequestError(f"{where}: a tool_use block needs an id and a name.", param=where)
    if not isinstance(arguments, Mapping):
        raise BadRequestError(f"{where}.input must be an object.", param=where)
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": text}}


def _user_turns(
    blocks: Sequence[Mapping[str, Any]], where: str, names: Mapping[str, str]
) -> list[dict[str, Any]]:
    results, text = [], []
    for j, block in enumerate(blocks):
        if block.get("type") == "tool_result":
            results.append(_result(block, f"{where}.{j}", names))
        else:
            text.append(block_text(block, f"{where}.{j}", "text or tool_result"))
    user = [{"role": "user", "content": "".join(text)}] if text or not results else []
    return [*results, *user]


def _result(block: Mapping[str, Any], where: str, names: Mapping[str, str]) -> dict[str, Any]:
    ident = block.get("tool_use_id")
    if not isinstance(ident, str):
        raise BadRequestError(f"{where}: a tool_result block needs a tool_use_id.", param=where)
    content = block.get("content") or ""
    if not isinstance(content, str):
        if not isinstance(content, list):
            raise BadRequestError(f"{where}.content must be text or blocks.", param=where)
        content = "".join(
            block_text(b, f"{where}.content.{k}", "text") for k, b in enumerate(content)
        )
    if block.get("is_error") is True:
        content = f"Error: {content}"
    turn = {"role": "tool", "tool_call_id": ident, "content": content}
    if ident in names:
        turn["name"] = names[ident]
    return turn


def block_text(block: Mapping[str, Any], where: str, allowed: str) -> str:
    """The text of a ``text`` block ('' for a dropped thinking block); BadRequestError
    naming ``allowed`` for any other type."""
    kind = block.get("type")
    text = block.get("text")
    if kind == "text" and isinstance(text, str):
        return text
    if kind in IGNORED_BLOCKS:
        return ""
    raise BadRequestError(
        f"{where}: content blocks of type {kind!r} are not supported here (only {allowed}).",
        param=where,
        code="unsupported",
    )
