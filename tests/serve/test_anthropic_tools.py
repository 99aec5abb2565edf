"""Tools on the Anthropic Messages API: the official ``anthropic`` client against a real
server on the tiny model (real tokenizer and chat template), and the block stream that
shapes replies, fed a reply's text."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
import trio
from anthropic.types import ToolUseBlock

from meshnode.generation.state import Delta, FinishReason
from meshnode.serve.single import build_single_node_service
from meshnode.serve.toolparse import ToolCallStream, ToolFormat
from meshnode.serve.toolreply import BlockStream, reply_events
from tests.serve.conftest import TINY_MODEL_ID, Server, start_server
from tests.serve.test_anthropic_api import raw_post

MODEL = TINY_MODEL_ID
REQUEST_TIMEOUT_S = 30.0
#: The fallback prompt listing two tools is ~270 tokens: more than the shared tiny
#: service's context; the tiny model allows 512 positions.
TOOLS_CONTEXT = 512
GREEDY: dict[str, Any] = {"temperature": 0}
#: Completion tokens of a forced call: its schema closes well within them.
BUDGET = 160
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME: dict[str, Any] = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}, "hours": {"type": "boolean"}},
        "required": ["zone", "hours"],
        "additionalProperties": False,
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
#: Both tools, typed loosely: the SDK's tool type is an invariant union of TypedDicts.
BOTH: Any = [WEATHER, TIME]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def as_openai(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


@pytest.fixture
async def tools_server(tiny_model_dir: Path, nursery: trio.Nursery) -> Server:
    service = build_single_node_service(
        str(tiny_model_dir), model_id=MODEL, context_size=TOOLS_CONTEXT
    )
    return await start_server(nursery, service)


def client(server: Server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


async def openai_prompt_tokens(server: Server, messages: Any, tools: Any = None) -> int:
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    extra = {"tools": tools} if tools else {}
    async with api:
        reply = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0, **extra
        )
    assert reply.usage is not None
    return int(reply.usage.prompt_tokens)


async def test_tools_reach_the_prompt_as_on_the_openai_route(tools_server: Server) -> None:
    async with client(tools_server) as c:
        plain = await c.messages.count_tokens(model=MODEL, messages=ASK)
        shown = await c.messages.count_tokens(model=MODEL, messages=ASK, tools=BOTH)
        hidden = await c.messages.count_tokens(
            model=MODEL, messages=ASK, tools=BOTH, tool_choice={"type": "none"}
        )
    # SmolLM2's template reads no tools: the Hermes fallback system prompt lists them.
    assert shown.input_tokens > plain.input_tokens + 50
    assert hidden.input_tokens == plain.input_tokens
    tools = [as_openai(WEATHER), as_openai(TIME)]
    assert shown.input_tokens == await openai_prompt_tokens(tools_server, ASK, tools)


async def test_a_history_of_calls_and_results_is_the_chat_completions_prompt(
    tools_server: Server,
) -> None:
    history: Any = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time",
             "input": {"zone": "CET", "hours": True}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny, 21 C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "clock down",
             "is_error": True},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]  # fmt: skip
    chat: Any = [
        *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "CET", "hours": true}'}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: clock down"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    async with client(tools_server) as c:
        counted = await c.messages.count_tokens(model=MODEL, messages=history, tools=BOTH)
        reply = await c.messages.create(
            model=MODEL, max_tokens=2, messages=history, tools=BOTH, extra_body=GREEDY
        )
    tools = [as_openai(WEATHER), as_openai(TIME)]
    expected = await openai_prompt_tokens(tools_server, chat, tools)
    assert counted.input_tokens == expected
    assert reply.usage.input_tokens == expected


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
    ],
)
async def test_forced_tool_use_is_valid_and_streams_the_same(
    tools_server: Server, choice: dict[str, Any]
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": BUDGET,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "extra_body": GREEDY,
    }
    async with client(tools_server) as c:
        reply = await c.messages.create(**request)
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert isinstance(block, ToolUseBlock)
    assert block.id.startswith("toolu_")
    if choice["type"] == "tool":
        assert block.name == "get_time"
    jsonschema.validate(block.input, TOOLS[block.name]["input_schema"])

    def read() -> tuple[list[Any], Any]:
        with anthropic.Anthropic(
            base_url=tools_server.base_url, api_key="unused", max_retries=0,
            timeout=REQUEST_TIMEOUT_S,
        ) as sync:  # fmt: skip
            events = list(sync.messages.create(stream=True, **request))
            with sync.messages.stream(**request) as stream:
                return events, stream.get_final_message()

    events, final = await trio.to_thread.run_sync(read)
    names = [event.type for event in events]
    assert names[0] == "message_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "tool_use")]
    assert starts[0].content_block.name == block.name
    assert starts[0].content_block.input == {}
    pieces = [e.delta for e in events if e.type == "content_block_delta"]
    assert {piece.type for piece in pieces} == {"input_json_delta"}
    assert json.loads("".join(piece.partial_json for piece in pieces)) == block.input
    assert events[-2].delta.stop_reason == "tool_use"
    assert events[-2].usage.output_tokens == reply.usage.output_tokens
    (whole,) = final.content
    assert isinstance(whole, ToolUseBlock)
    assert (whole.name, whole.input) == (block.name, block.input)
    assert final.stop_reason == "tool_use"


BAD_TOOL_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]},
     "tool_result"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Sure:"}], "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
      "content": [{"type": "image", "source": {}}]}]}]}, "'image'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "'tool_use'"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "says"), BAD_TOOL_REQUESTS)
async def test_bad_tool_requests_get_anthropics_error_shape(
    tools_server: Server, extra: dict[str, Any], says: str
) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **extra}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = await raw_post(tools_server, path, body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert says in error["message"], error["message"]


# -- the block stream, fed a reply's text -------------------------------------------------

#: A Hermes reply with text before its call, as a model writing calls in auto mode sends it.
HERMES_REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call>"
)


def feed(stream: BlockStream, pieces: list[str]) -> list[tuple[str, dict[str, Any]]]:
    events = stream.start()
    for i, piece in enumerate(pieces):
        events += stream.push(piece, final=i == len(pieces) - 1)
    return events


@pytest.mark.parametrize("size", [1, 3, len(HERMES_REPLY)])
def test_text_then_a_call_become_a_text_block_and_a_tool_use_block(size: int) -> None:
    stream = BlockStream(ToolCallStream(ToolFormat.HERMES))
    pieces = [HERMES_REPLY[i : i + size] for i in range(0, len(HERMES_REPLY), size)]
    events = feed(stream, pieces)
    blocks = stream.blocks()
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[0]["text"] == "Let me check."
    assert (blocks[1]["name"], blocks[1]["input"]) == ("get_weather", {"city": "Paris"})
    assert blocks[1]["id"].startswith("toolu_")
    assert stream.made_calls
    # Every block opens, takes its deltas and closes before the next one opens.
    opened: list[int] = []
    text, arguments = "", ""
    for name, payload in events:
        if name == "content_block_start":
            assert payload["index"] == len(opened)
            opened.append(payload["index"])
        elif name == "content_block_stop":
            assert payload["index"] == opened[-1]
        else:
            assert payload["index"] == opened[-1]
            delta = payload["delta"]
            text += delta.get("text", "")
            arguments += delta.get("partial_json", "")
    starts = [p["content_block"] for n, p in events if n == "content_block_start"]
    assert starts[1] == {"type": "tool_use", "id": blocks[1]["id"], "name": "get_weather",
                         "input": {}}  # fmt: skip
    assert [n for n, _ in events].count("content_block_stop") == 2
    assert text == "Let me check."
    assert json.loads(arguments) == {"city": "Paris"}


def test_a_reply_without_calls_is_one_text_block_however_it_streams() -> None:
    with_tools = BlockStream(ToolCallStream(ToolFormat.HERMES))
    assert feed(with_tools, ["Sunny", " <tool", "ish."])[0][0] == "content_block_start"
    assert with_tools.blocks() == [{"type": "text", "text": "Sunny <toolish."}]
    assert not with_tools.made_calls
    without = BlockStream(None)
    events = feed(without, ["", ""])
    assert [n for n, _ in events] == ["content_block_start", "content_block_stop"]
    assert without.blocks() == [{"type": "text", "text": ""}]


async def test_reply_events_end_every_stream_and_close_the_deltas() -> None:
    """The stream driver of /v1/messages and /v1/responses: a stream that stops without a
    finish reason still closes its blocks; leaving early closes the deltas at once."""
    closed: list[str] = []

    async def deltas(*texts: str, finish: bool) -> AsyncGenerator[Delta, None]:
        try:
            for i, text in enumerate(texts):
                last = finish and i == len(texts) - 1
                yield Delta(text, (), finish_reason=FinishReason.STOP if last else None)
        finally:
            closed.append("".join(texts))

    for finish in (True, False):
        stream = BlockStream(None)
        names = [n for n, _ in stream.start()]
        names += [n async for n, _ in reply_events(deltas("Hel", "lo", finish=finish), stream)]
        assert names.count("content_block_stop") == 1, names
        assert stream.blocks() == [{"type": "text", "text": "Hello"}]
    assert closed == ["Hello", "Hello"]
    stream = BlockStream(None)
    stream.start()
    events = reply_events(deltas("a", "b", "c", finish=True), stream)
    assert (await events.__anext__())[0] == "content_block_delta"
    assert closed[-1] == "Hello"  # still streaming
    await events.aclose()
    assert closed[-1] == "abc"
