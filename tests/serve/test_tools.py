"""Tools on the way in: checks of tools and tool_choice, and the prompts that show them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshnode.engine.tokenizer import ChatTemplate
from meshnode.serve.errors import BadRequestError
from meshnode.serve.toolparse import ToolFormat
from meshnode.serve.tools import ToolChoice, render_chat, tool_format, tool_plan

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

#: A Qwen-style template that reads ``tools`` and renders calls and results itself.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for tc in m.tool_calls %}<tool_call>{{ tc.function.name }} "
    "{{ tc.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response id={{ m.tool_call_id }}>"
    "{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "retrieval"}], None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
    ],
)
def test_bad_tools_and_choices_are_400(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        tool_plan(tools, choice, ToolFormat.HERMES)
    assert info.value.param == param


def test_tool_choice_defaults_and_forced_tools() -> None:
    assert tool_plan(None, None, ToolFormat.HERMES).choice == ToolChoice("none")
    auto = tool_plan([WEATHER], None, ToolFormat.HERMES)
    assert auto.choice == ToolChoice("auto")
    assert not auto.forced
    assert auto.parser() is not None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert [s.name for s in tool_plan([WEATHER], named, ToolFormat.HERMES).forced] == [
        "get_weather"
    ]
    none = tool_plan([WEATHER], "none", ToolFormat.HERMES)
    assert none.shown == ()
    assert none.parser() is None
    # A function without parameters takes an empty object.
    bare = tool_plan([{"type": "function", "function": {"name": "f"}}], None, ToolFormat.HERMES)
    assert bare.specs[0].parameters == {"type": "object", "properties": {}}


def test_a_template_that_reads_tools_gets_them_and_the_history_as_objects() -> None:
    template = ChatTemplate(TOOL_TEMPLATE)
    assert template.reads_tools
    specs = tool_plan([WEATHER], None, ToolFormat.HERMES).shown
    prompt = render_chat(template, HISTORY, specs)
    assert json.dumps(WEATHER) in prompt  # tojson of the OpenAI tool object
    # Arguments reach the template as an object (tojson prints it as JSON, not a string).
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in prompt
    assert "<tool_response id=call_1>sunny</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_hermes_fallback() -> None:
    template = ChatTemplate(PLAIN_TEMPLATE)
    assert not template.reads_tools
    specs = tool_plan([WEATHER], None, ToolFormat.HERMES).shown
    prompt = render_chat(template, HISTORY, specs)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")  # the user's first
    assert json.dumps(WEATHER) in system
    assert "<tool_call></tool_call> XML tags" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt
    # Without tools and tool history, the plain path renders exactly what it did before.
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(template, plain) == template.render(plain)


@pytest.mark.parametrize(
    ("source", "reads", "expected"),
    [
        (None, False, ToolFormat.HERMES),
        (PLAIN_TEMPLATE, False, ToolFormat.HERMES),
        (TOOL_TEMPLATE, True, ToolFormat.HERMES),
        ("{{ tools }}[TOOL_CALLS]", True, ToolFormat.MISTRAL),
        ("{{ tools }}<|python_tag|><|start_header_id|>", True, ToolFormat.LLAMA3_JSON),
    ],
)
def test_the_parser_follows_the_template(
    source: str | None, reads: bool, expected: ToolFormat
) -> None:
    if source is not None:
        assert ChatTemplate(source).reads_tools is reads
    assert tool_format(source, reads) is expected
