"""The request of OpenAI's Responses API (``POST /v1/responses``) and its translation to a
chat: the turns, the tool plan and the ``response_format`` the chat completions route
takes, so that both share one prompt renderer, tool parser and grammar.

The same leniency as :mod:`meshnode.serve.schemas`: unknown fields are ignored (logged
once), known fields are strict. What needs state this server does not keep is a 400
naming it: ``previous_response_id`` and ``conversation`` (responses are not stored; send
the whole input each time, as with ``store: false``), ``background``, and ``item_reference``
inputs. Hosted tools (``web_search``, ``file_search``, ``code_interpreter``…), images and
files are a 400 too.

Input items map to chat turns: a message (``role`` and text or ``input_text``/
``output_text`` parts) to its turn, ``instructions`` to a system turn first, a
``function_call`` to a call of the assistant turn before it (or of a new one), and a
``function_call_output`` to a ``tool`` turn. ``reasoning`` items are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from meshnode.serve.errors import BadRequestError
from meshnode.serve.schemas import PositiveInt, RequestModel, Text
from meshnode.serve.toolparse import ToolFormat
from meshnode.serve.tools import (
    ToolPlan,
    ToolSpec,
    check_tool_count,
    function_spec,
    tool_choice,
    unique_specs,
)

__all__ = ["ResponsesRequest"]

#: Content part types whose text is read (a client sends back earlier outputs as
#: ``output_text``).
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
#: Fields that need a response or conversation stored here, which this server never does.
STATEFUL_FIELDS = ("previous_response_id", "conversation")


class ResponsesRequest(RequestModel):
    model: StrictStr
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=1.0)] | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: StrictStr | None = None
    conversation: str | dict[str, Any] | None = None
    background: StrictBool | None = None

    def check_supported(self) -> None:
        """Raise BadRequestError for what needs state or features this server lacks."""
        for name in STATEFUL_FIELDS:
            if getattr(self, name) is not None:
                raise BadRequestError(
                    f"{name} is not supported: responses are not stored here; send the "
                    "whole conversation as input.",
                    param=name,
                    code="unsupported",
                )
        if self.background:
            raise BadRequestError(
                "background responses are not supported.", param="background", code="unsupported"
            )

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling settings the request gave (omitted ones are left to the model)."""
        given = {"temperature": self.temperature, "top_p": self.top_p}
        return {name: value for name, value in given.items() if value is not None}

    def tool_plan(self, fmt: ToolFormat) -> ToolPlan:
        """The plan of ``tools``, ``tool_choice`` and ``parallel_tool_calls``; raises
        BadRequestError (param ``tools`` or ``tool_choice``) for a bad one."""
        specs = _specs(self.tools or [])
        choice = self.tool_choice
        if isinstance(choice, Mapping) and choice.get("type") == "function":
            # The Responses API names the function at the top level of the choice.
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        return ToolPlan(
            tuple(specs), tool_choice(choice, specs), fmt, self.parallel_tool_calls is not False
        )

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat completions' ``response_format`` (None: text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, Mapping):
            raise BadRequestError("text.format must be an object.", param="text")
        if fmt.get("type") != "json_schema":
            return dict(fmt)  # text, json_object, or a type request_grammar refuses
        schema = fmt.get("schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}

    def turns(self) -> list[dict[str, Any]]:
        """The chat turns (as :func:`meshnode.serve.tools.render_chat` takes them) of
        ``instructions`` and ``input``; raises BadRequestError for an item it cannot read."""
        turns: list[dict[str, Any]] = []
        if self.instructions is not None:
            turns.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*turns, {"role": "user", "content": self.input}]
        names: dict[str, str] = {}  # call_id → the function's name, for the outputs
        for i, item in enumerate(self.input):
            _add_item(turns, item, f"input.{i}", names)
        if not turns:
            raise BadRequestError("input has no message.", param="input")
        return turns


def _specs(tools: list[dict[str, Any]]) -> list[ToolSpec]:
    check_tool_count(tools)
    specs = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if tool.get("type") != "function":
            raise BadRequestError(
                f"{where}: tools of type {tool.get('type')!r} are not supported (only "
                "function tools, which the client runs).",
                param="tools",
                code="unsupported",
            )
        name, description = tool.get("name"), tool.get("description")
        specs.append(function_spec(where, name, description, tool.get("parameters")))
    return unique_specs(specs)


def _add_item(
    turns: list[dict[str, Any]], item: Mapping[str, Any], where: str, names: dict[str, str]
) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BadRequestError(f"{where}.role must be user, system, developer or assistant.",
                                  param="input")  # fmt: skip
        turns.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            raise BadRequestError(f"{where}: a function_call needs call_id, name and arguments "
                                  "(text).", param="input")  # fmt: skip
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        names[str(call_id)] = str(name)
        if not turns or turns[-1]["role"] != "assistant":
            turns.append({"role": "assistant", "content": ""})
        turns[-1].setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise BadRequestError(
                f"{where}: a function_call_output needs a call_id.", param="input"
            )
        turn = {"role": "tool", "tool_call_id": call_id,
                "content": _text(item.get("output"), f"{where}.output")}  # fmt: skip
        if call_id in names:
            turn["name"] = names[call_id]
        turns.append(turn)
    elif kind != "reasoning":
        raise BadRequestError(f"{where}: input items of type {kind!r} are not supported.",
                              param="input", code="unsupported")  # fmt: skip


def _text(content: Any, where: str) -> str:
    """Text, or text parts joined; BadRequestError for any other part."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequestError(f"{where} must be text or a list of parts.", param="input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind != "refusal":
            raise BadRequestError(f"{where}.{j}: parts of type {kind!r} are not supported "
                                  "(only text).", param="input", code="unsupported")  # fmt: skip
    return "".join(out)
