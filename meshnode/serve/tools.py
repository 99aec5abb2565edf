"""Tools on the way in: the request's tools and tool choice, and the prompt that shows them.

A chat with ``tools`` is rendered through the model's own chat template, which receives
``tools`` (OpenAI's list of ``{"type": "function", "function": {…}}``, as transformers'
``apply_chat_template`` passes it) and the history with assistant ``tool_calls`` (arguments
as objects, as templates expect) and ``tool`` results (``tool_call_id``, ``name``).

**Fallback.** A template that never reads ``tools`` (SmolLM2's, Gemma's) would silently
drop them. Such a model gets the Hermes convention instead, which most small instruct
models have seen in training: a system prompt listing the tools inside ``<tools></tools>``
and asking for ``<tool_call>{"name": …, "arguments": …}</tool_call>`` (the wording of
Qwen 2.5's template), earlier calls written back the same way, and tool results as user
turns wrapped in ``<tool_response></tool_response>``. Its replies are parsed as ``hermes``.

**Which parser** (:func:`tool_format`): a template that mentions ``[TOOL_CALLS]`` writes
Mistral calls; one that mentions ``<|python_tag|>`` or Llama 3's header tokens writes
Llama 3 JSON; anything else (``<tool_call>`` templates and the fallback) Hermes.

``tool_choice``: ``none`` renders no tools and parses nothing (the reply is plain text);
``auto`` (the default with tools) renders them and parses calls out of the reply;
``required`` and a named function also force a call by constrained decoding
(:mod:`meshnode.serve.structured`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from meshnode.engine.tokenizer import ChatTemplate
from meshnode.serve.errors import BadRequestError
from meshnode.serve.toolparse import ToolCallStream, ToolFormat

__all__ = [
    "ToolChoice",
    "ToolPlan",
    "ToolSpec",
    "check_tool_count",
    "fallback_messages",
    "function_spec",
    "render_chat",
    "template_messages",
    "tool_choice",
    "tool_format",
    "tool_plan",
    "tool_specs",
    "unique_specs",
]

#: OpenAI's rule for function names (and what every template can print unescaped).
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Tools one request may declare: each one is rendered into the prompt and compiled into the
#: grammar of a forced call, so the bound keeps both small (OpenAI allows 128).
MAX_TOOLS = 128
#: Levels of nesting an earlier call's arguments may have. Real arguments nest a few levels
#: (OpenAI's strict schemas allow 10), while the parser, the template's ``tojson`` and
#: ``json.dumps`` recurse once per level on a stack already a few hundred frames deep
#: (Python's limit is 1,000): 3,000 levels were a ``RecursionError`` (issue 36, item 11).
MAX_ARGUMENT_DEPTH = 64

FALLBACK_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and chat templates) write it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the request lets or makes the model do with its tools."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether a call is forced (by constrained decoding)."""
        return self.mode in ("required", "named")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request does with tools: which it shows, what it lets the model do, how
    the reply is parsed and whether several calls are allowed."""

    specs: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    format: ToolFormat = ToolFormat.HERMES
    parallel: bool = True

    @property
    def shown(self) -> tuple[ToolSpec, ...]:
        """The tools rendered into the prompt (none with ``tool_choice: none``)."""
        return () if self.choice.mode == "none" else self.specs

    @property
    def forced(self) -> tuple[ToolSpec, ...]:
        """The tools one of which the reply must call (empty: no call is forced)."""
        if self.choice.mode == "named":
            return tuple(s for s in self.specs if s.name == self.choice.name)
        return self.specs if self.choice.mode == "required" else ()

    @property
    def calls_finish_reason(self) -> str:
        """The ``finish_reason`` of a reply that made calls and ended by itself:
        ``tool_calls``, except ``stop`` for a named ``tool_choice``, as OpenAI answers
        (its replies, streamed or not, are tabled in vllm-project/vllm#25054)."""
        return "stop" if self.choice.mode == "named" else "tool_calls"

    def parser(self) -> ToolCallStream | None:
        """A fresh parser of the reply's calls, or None when the reply is plain text."""
        if not self.shown:
            return None
        return ToolCallStream(self.format, single=not self.parallel)


def tool_plan(
    tools: Sequence[Mapping[str, Any]] | None,
    choice: str | Mapping[str, Any] | None,
    fmt: ToolFormat,
    parallel: bool | None = None,
) -> ToolPlan:
    """The plan of a request's ``tools``/``tool_choice``/``parallel_tool_calls``; raises
    BadRequestError for a bad tool or choice."""
    specs = tool_specs(tools)
    return ToolPlan(tuple(specs), tool_choice(choice, specs), fmt, parallel is not False)


def tool_specs(tools: Sequence[Mapping[str, Any]] | None) -> list[ToolSpec]:
    """The request's tools, checked; raises BadRequestError (param ``tools``) for a bad one."""
    if not tools:
        return []
    check_tool_count(tools)
    return unique_specs([_spec(i, tool) for i, tool in enumerate(tools)])


def check_tool_count(tools: Sequence[object]) -> None:
    """Raise BadRequestError (param ``tools``) for more than :data:`MAX_TOOLS` tools."""
    if len(tools) > MAX_TOOLS:
        raise BadRequestError(f"At most {MAX_TOOLS} tools are allowed.", param="tools")


def unique_specs(specs: list[ToolSpec]) -> list[ToolSpec]:
    """``specs``; raises BadRequestError (param ``tools``) if two share a name."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise BadRequestError("Tool names must be unique.", param="tools")
    return specs


def _spec(index: int, tool: Mapping[str, Any]) -> ToolSpec:
    where = f"tools[{index}]"
    if tool.get("type") != "function":
        raise BadRequestError(f"{where}.type must be 'function'.", param="tools")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise BadRequestError(f"{where}.function must be an object.", param="tools")
    return function_spec(
        f"{where}.function",
        function.get("name"),
        function.get("description"),
        function.get("parameters"),
    )


def function_spec(
    where: str,
    name: object,
    description: object,
    parameters: object,
    schema_key: str = "parameters",
) -> ToolSpec:
    """A checked tool from its parts as a request gave them (``where`` names the tool in
    errors, ``schema_key`` its schema's field; no schema takes no arguments); raises
    BadRequestError (param ``tools``) for a bad name, description or schema."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequestError(
            f"{where}.name must be 1-64 letters, digits, '_' or '-'.", param="tools"
        )
    if description is not None and not isinstance(description, str):
        raise BadRequestError(f"{where}.description must be a string.", param="tools")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise BadRequestError(f"{where}.{schema_key} must be a JSON schema object.", param="tools")
    return ToolSpec(name, description, parameters)


def tool_choice(raw: str | Mapping[str, Any] | None, specs: Sequence[ToolSpec]) -> ToolChoice:
    """The request's ``tool_choice`` (default: ``auto`` with tools, else ``none``).

    Raises BadRequestError (param ``tool_choice``) for an unknown value, a choice that needs
    tools when there are none, or a function that is not among them.
    """
    if raw is None:
        return ToolChoice("auto" if specs else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise BadRequestError(
                "tool_choice must be 'none', 'auto', 'required' or a function.",
                param="tool_choice",
            )
        if raw != "none" and not specs:
            raise BadRequestError(f"tool_choice '{raw}' needs tools.", param="tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    function = raw.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if raw.get("type") != "function" or not isinstance(name, str):
        raise BadRequestError(
            'A named tool_choice is {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if name not in {s.name for s in specs}:
        raise BadRequestError(
            f"tool_choice names '{name}', which is not a tool.", param="tool_choice"
        )
    return ToolChoice("named", name)


def tool_format(template_source: str | None, reads_tools: bool) -> ToolFormat:
    """The format a model with this chat template writes calls in (module docstring)."""
    if template_source is None or not reads_tools:
        return ToolFormat.HERMES  # the fallback prompt asks for Hermes calls
    if "[TOOL_CALLS]" in template_source:
        return ToolFormat.MISTRAL
    if "<|python_tag|>" in template_source or "<|start_header_id|>" in template_source:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


# -- messages -----------------------------------------------------------------------------


def render_chat(
    template: ChatTemplate | None,
    messages: Sequence[Mapping[str, Any]],
    specs: Sequence[ToolSpec] = (),
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a chat, tools shown as the template (or the fallback) does, and
    (with ``add_generation_prompt``) the assistant's turn opened.

    ``messages`` are dicts with ``role`` and ``content`` (text or None), and where they
    have them ``tool_calls`` (OpenAI's shape, arguments as JSON text), ``tool_call_id`` and
    ``name``. Raises :class:`~meshnode.engine.tokenizer.TemplateError` if the template fails.
    """
    with_tools = bool(specs) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if with_tools and template is not None and template.reads_tools:
        tools = [s.as_openai() for s in specs] or None
        return template.render(
            template_messages(messages), add_generation_prompt=add_generation_prompt, tools=tools
        )
    if with_tools:
        messages = fallback_messages(messages, specs)
    plain = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    if template is None:
        # A model without a template still chats: plain role-prefixed turns.
        turns = "".join(f"{m['role']}: {m['content']}\n" for m in plain)
        return turns + "assistant:" if add_generation_prompt else turns
    return template.render(plain, add_generation_prompt=add_generation_prompt)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The history as a tool-aware template reads it: content as text, call arguments as
    objects (templates print them with ``tojson``), tool results with their call id."""
    out = []
    for message in messages:
        entry: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
        if calls := message.get("tool_calls"):
            entry["tool_calls"] = [_template_call(c) for c in calls]
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                entry[key] = message[key]
        out.append(entry)
    return out


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function["arguments"])},
    }


def _arguments(text: str) -> Any:
    """Arguments as an object when they are JSON (as vLLM hands them to templates); raise
    BadRequestError when they nest deeper than :data:`MAX_ARGUMENT_DEPTH`."""
    try:
        value = json.loads(text)
        too_deep = json_depth(value) > MAX_ARGUMENT_DEPTH
    except json.JSONDecodeError:
        return text
    except RecursionError:
        too_deep = True  # deeper than the parser's own stack
    if too_deep:
        raise BadRequestError(
            f"messages: a tool call's arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels.",
            param="messages",
        )
    return value


def json_depth(value: Any) -> int:
    """Levels of arrays and objects in a parsed JSON ``value`` (a scalar is 0), counted
    without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], specs: Sequence[ToolSpec]
) -> list[dict[str, str]]:
    """The history in the Hermes convention for a template without tool support (module
    docstring): plain ``role``/``content`` turns any template renders."""
    system = ""
    if specs:
        listing = "\n".join(json.dumps(s.as_openai(), ensure_ascii=False) for s in specs)
        system = FALLBACK_SYSTEM_PROMPT.format(tools=listing)
    out: list[dict[str, str]] = []
    for message in messages:
        role, content = str(message["role"]), str(message.get("content") or "")
        if role in ("system", "developer") and not out and system:
            system = content + "\n\n" + system
            continue
        if role == "assistant" and message.get("tool_calls"):
            content = "\n".join([content, *(_hermes_call(c) for c in message["tool_calls"])])
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and "<tool_response>" in out[-1]["content"]:
                out[-1]["content"] += "\n" + content  # one turn for a round of results
                continue
        if role == "assistant":
            content = content.strip("\n")
        out.append({"role": role, "content": content})
    return [{"role": "system", "content": system}, *out] if system else out


def _hermes_call(call: Mapping[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": _arguments(function["arguments"])}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
