"""OpenAI's Responses API on a real hypercorn server over the tiny model (real tokenizer
and chat template), driven by the official ``openai`` client's ``responses``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
import trio
from pydantic import BaseModel

from meshnode.serve.single import build_single_node_service
from tests.serve.conftest import TINY_MODEL_ID, Server, start_server
from tests.serve.test_openai_api import assert_openai_error, post

MODEL = TINY_MODEL_ID
REQUEST_TIMEOUT_S = 30.0
#: The Hermes fallback prompt listing tools needs more than the shared service's context.
TOOLS_CONTEXT = 512
USER: Any = [{"role": "user", "content": "Name a colour."}]
TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "hours": {"type": "boolean"}},
    "required": ["zone", "hours"],
    "additionalProperties": False,
}
TIME: Any = {"type": "function", "name": "get_time", "parameters": TIME_PARAMETERS}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip
PICK: dict[str, Any] = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip


def sync_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip


@pytest.fixture
async def tools_server(tiny_model_dir: Path, nursery: trio.Nursery) -> Server:
    service = build_single_node_service(
        str(tiny_model_dir), model_id=MODEL, context_size=TOOLS_CONTEXT
    )
    return await start_server(nursery, service)


async def test_a_response_is_the_chat_completion_of_the_same_conversation(
    server: Server,
) -> None:
    async with client(server) as api:
        reply = await api.responses.create(
            model=MODEL, instructions="Be brief.", input=USER, max_output_tokens=12,
            temperature=0,
        )  # fmt: skip
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *USER],
            max_tokens=12, temperature=0,
        )  # fmt: skip
    assert reply.object == "response"
    assert reply.id.startswith("resp_")
    assert reply.model == MODEL
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == chat.choices[0].message.content
    assert chat.usage is not None
    assert reply.usage is not None
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert reply.status == "incomplete"
        assert reply.incomplete_details is not None
        assert reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed"


async def test_a_string_input_is_one_user_message(server: Server) -> None:
    async with client(server) as api:
        text = await api.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        parts: Any = [{"type": "input_text", "text": "Hi"}]
        listed = await api.responses.create(
            model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=1
        )
    assert text.usage is not None
    assert listed.usage is not None
    assert text.usage.input_tokens == listed.usage.input_tokens


def read_stream(server: Server, **request: Any) -> tuple[list[Any], Any]:
    """Every raw event of one streamed response, and the response the SDK's stream helper
    (which checks each item's identity as it accumulates them) ends with: its
    ``get_final_response`` when completed, else that of its ``response.incomplete``."""
    with sync_client(server) as api:
        events = list(api.responses.create(stream=True, **request))
        with api.responses.stream(**request) as stream:
            last = list(stream)[-1]
            if last.type == "response.completed":
                return events, stream.get_final_response()
            assert last.type == "response.incomplete"
            return events, last.response


async def test_streaming_follows_the_responses_event_sequence(server: Server) -> None:
    request: dict[str, Any] = {"model": MODEL, "input": USER, "max_output_tokens": 10,
                               "temperature": 0}  # fmt: skip
    events, final = await trio.to_thread.run_sync(lambda: read_stream(server, **request))
    async with client(server) as api:
        whole = await api.responses.create(**request)
    names = [event.type for event in events]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert set(names[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert final.output_text == whole.output_text
    assert final.status == whole.status
    assert whole.usage is not None
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
async def test_forced_function_calls_are_valid_and_stream_the_same(
    tools_server: Server, choice: Any
) -> None:
    request: dict[str, Any] = {
        "model": MODEL, "input": "What time is it in Paris?", "tools": [WEATHER, TIME],
        "tool_choice": choice, "parallel_tool_calls": False, "max_output_tokens": 160,
        "temperature": 0,
    }  # fmt: skip
    async with client(tools_server) as api:
        reply = await api.responses.create(**request)
    assert reply.status == "completed"
    (call,) = reply.output
    assert call.type == "function_call"
    assert call.call_id.startswith("call_")
    if isinstance(choice, dict):
        assert call.name == "get_time"
    schema = {"get_time": TIME, "get_weather": WEATHER}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)

    events, final = await trio.to_thread.run_sync(lambda: read_stream(tools_server, **request))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    (streamed,) = final.output
    assert streamed.type == "function_call"
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


async def test_calls_and_their_outputs_in_the_input_are_the_chat_completions_prompt(
    tools_server: Server,
) -> None:
    arguments = '{"zone": "CET", "hours": true}'
    history: Any = [
        {"role": "user", "content": "What time is it in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "14:02"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    chat: Any = [
        {"role": "user", "content": "What time is it in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:02"},
    ]  # fmt: skip
    chat_tool: Any = {
        "type": "function",
        "function": {"name": "get_time", "parameters": TIME_PARAMETERS},
    }
    async with client(tools_server) as api:
        reply = await api.responses.create(
            model=MODEL, input=history, tools=[TIME], max_output_tokens=1
        )
        completion = await api.chat.completions.create(
            model=MODEL, messages=chat, tools=[chat_tool], max_tokens=1
        )
    assert reply.usage is not None
    assert completion.usage is not None
    assert reply.usage.input_tokens == completion.usage.prompt_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_json_schema_text_format_is_enforced(server: Server, temperature: float) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}}
    async with client(server) as api:
        reply = await api.responses.create(
            model=MODEL, input=USER, text=text, max_output_tokens=32, temperature=temperature
        )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), PICK)


class Pick(BaseModel):
    colour: Literal["red", "blue"]
    ok: bool


async def test_the_sdks_parse_gets_an_instance_of_its_model(server: Server) -> None:
    async with client(server) as api:
        reply = await api.responses.parse(
            model=MODEL, input=USER, text_format=Pick, max_output_tokens=32, temperature=1.0
        )
    assert isinstance(reply.output_parsed, Pick)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"text": {"format": {"type": "xml"}}}, "response_format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)  # fmt: skip
async def test_bad_requests_get_openai_shaped_errors(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "Hi", **extra}
    error = assert_openai_error(await post(server, "/v1/responses", body), 400)
    assert error["param"] == param


async def test_an_unknown_model_is_404(server: Server) -> None:
    async with client(server) as api:
        with pytest.raises(openai.NotFoundError):
            await api.responses.create(model="nope", input="Hi")
