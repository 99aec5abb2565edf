"""The Anthropic Messages API on a real hypercorn server, driven by the official
``anthropic`` client (and httpx for bodies the client would not send)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
import trio
from anthropic.types import Message, TextBlock
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from tests.serve.conftest import TINY_CONTEXT, TINY_MODEL_ID, Server

MODEL = TINY_MODEL_ID
REQUEST_TIMEOUT_S = 30.0
#: Greedy, so replies are comparable across the two APIs (Anthropic's SDK takes sampling
#: settings only as extra fields now; the server reads them as the Messages API defines).
GREEDY: dict[str, Any] = {"temperature": 0}
#: Typed loosely: the two SDKs' message types are invariant unions of TypedDicts.
USER: Any = [{"role": "user", "content": "Name a colour."}]


def text_of(message: Message) -> str:
    """The text of a one-block reply."""
    (block,) = message.content
    assert isinstance(block, TextBlock)
    return block.text


def client(server: Server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


async def openai_greedy(server: Server, messages: Any, max_tokens: int) -> ChatCompletion:
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    async with api:
        return await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
        )


async def test_a_message_equals_the_chat_completion_of_the_same_conversation(
    server: Server,
) -> None:
    async with client(server) as c:
        reply = await c.messages.create(
            model=MODEL, max_tokens=12, system="Be brief.", messages=USER, extra_body=GREEDY
        )
    chat = await openai_greedy(server, [{"role": "system", "content": "Be brief."}, *USER], 12)
    assert reply.type == "message"
    assert reply.role == "assistant"
    assert reply.model == MODEL
    assert reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert text_of(reply) == chat.choices[0].message.content
    assert chat.usage is not None
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert reply.stop_reason == expected
    assert reply.stop_sequence is None


def stream_events(server: Server, **request: Any) -> list[Any]:
    """Every raw event of one streamed message, read by the official sync client (its async
    stream, like openai's, leaves generators to the garbage collector under trio)."""
    with anthropic.Anthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as c:
        return list(c.messages.create(stream=True, **request))


async def test_streaming_follows_anthropics_event_sequence(server: Server) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": USER,
        "extra_body": GREEDY,
    }
    events = await trio.to_thread.run_sync(lambda: stream_events(server, **request))
    async with client(server) as c:
        whole = await c.messages.create(**request)
    names = [event.type for event in events]  # the SDK does not hand out pings
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0].message
    # message_start comes before the prefill: all of the prompt, none of it known cached
    # yet (the whole reply came second and read the prefix the stream left in the cache).
    assert whole.usage.cache_read_input_tokens
    cached = whole.usage.cache_read_input_tokens
    assert start.usage.input_tokens == whole.usage.input_tokens + cached
    assert start.content == []
    assert start.stop_reason is None
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(whole)
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason
    assert delta.usage.output_tokens == whole.usage.output_tokens


async def test_each_event_names_itself_on_the_wire(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": USER, "stream": True, **GREEDY}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        response = await http.post(server.base_url + "/v1/messages", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = [frame for frame in response.text.split("\n\n") if frame]
    names = []
    for frame in frames:
        event, data = frame.split("\n")
        name = event.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_the_sdks_stream_helper_accumulates_the_same_message(server: Server) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": USER,
        "extra_body": GREEDY,
    }

    def read() -> Any:
        with (
            anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as c,
            c.messages.stream(**request) as stream,
        ):
            return stream.get_final_message()

    final = await trio.to_thread.run_sync(read)
    async with client(server) as c:
        whole = await c.messages.create(**request)
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_a_stop_sequence_ends_the_reply_and_is_named(server: Server) -> None:
    async with client(server) as c:
        free = await c.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
        text = text_of(free)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip(), f"the reply {text!r} has no usable stop string"
        cut = await c.messages.create(
            model=MODEL, max_tokens=16, messages=USER, stop_sequences=["\x00never", stop],
            extra_body=GREEDY,
        )  # fmt: skip
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert text_of(cut) == text[: text.find(stop)]


async def test_an_assistant_prefill_is_continued(server: Server) -> None:
    prefill = "My answer:"
    messages: Any = [*USER, {"role": "assistant", "content": prefill}]
    async with client(server) as c:
        counted = await c.messages.count_tokens(model=MODEL, messages=messages)
        reply = await c.messages.create(
            model=MODEL, max_tokens=4, messages=messages, extra_body=GREEDY
        )
    codec = server.service.codec
    expected = codec.encode(codec.render_chat(USER) + prefill)
    assert counted.input_tokens == len(expected)
    assert reply.usage.input_tokens == len(expected)


async def test_a_prompt_that_fills_the_context_stops_for_the_context(server: Server) -> None:
    codec = server.service.codec
    base = len(codec.encode(codec.render_chat([{"role": "user", "content": ""}])))
    words = " ".join(["apple"] * (TINY_CONTEXT - base - 4))
    async with client(server) as c:
        reply = await c.messages.create(
            model=MODEL,
            max_tokens=100,
            messages=[{"role": "user", "content": words}],
            extra_body=GREEDY,
        )
    assert TINY_CONTEXT - reply.usage.input_tokens < 100
    assert reply.usage.input_tokens + reply.usage.output_tokens == TINY_CONTEXT
    assert reply.stop_reason == "model_context_window_exceeded"


# -- structured output ----------------------------------------------------------------------

#: A bounded schema, so that even a random model at temperature 1 closes it at once.
PICK: dict[str, Any] = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


class Pick(BaseModel):
    colour: Literal["red", "blue"]
    ok: bool


@pytest.mark.parametrize("temperature", [0, 1])
async def test_output_config_format_is_enforced(server: Server, temperature: int) -> None:
    output_config: Any = {"format": {"type": "json_schema", "schema": PICK}}
    async with client(server) as c:
        reply = await c.messages.create(
            model=MODEL, max_tokens=32, messages=USER, output_config=output_config,
            extra_body={"temperature": temperature},
        )  # fmt: skip
        parsed = await c.messages.parse(
            model=MODEL, max_tokens=32, messages=USER, output_format=Pick,
            extra_body={"temperature": temperature},
        )  # fmt: skip
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(reply)), PICK)
    assert isinstance(parsed.parsed_output, Pick)


async def test_the_betas_output_format_is_enforced_and_bad_formats_are_400(
    server: Server,
) -> None:
    body = {"model": MODEL, "max_tokens": 32, "messages": USER, **GREEDY}
    beta = {**body, "output_format": {"type": "json_schema", "schema": PICK}}
    response = await raw_post(server, "/v1/messages", beta)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["content"][0]["text"]), PICK)
    for bad in ({"type": "json_object"}, {"type": "json_schema", "schema": []}):
        response = await raw_post(
            server, "/v1/messages", {**body, "output_config": {"format": bad}}
        )
        assert response.status_code == 400, response.text
        assert "output_config.format" in response.json()["error"]["message"]
    unknown = {"type": "json_schema", "schema": {"type": "nothing"}}
    response = await raw_post(server, "/v1/messages", {**body, "output_format": unknown})
    assert response.status_code == 400, response.text


# -- errors in Anthropic's shape ------------------------------------------------------------


async def raw_post(server: Server, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        if isinstance(body, bytes):
            return await http.post(server.base_url + path, content=body)
        return await http.post(server.base_url + path, json=body)


@pytest.mark.parametrize(
    ("body", "status", "kind", "says"),
    [
        ({"model": MODEL, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
        ({"model": MODEL, "max_tokens": 0, "messages": USER}, 400, "invalid_request_error",
         "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": USER, "temperature": 1.5}, 400,
         "invalid_request_error", "temperature"),
        ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error",
         "messages"),
        ({"model": "claude-nope", "max_tokens": 4, "messages": USER}, 404, "not_found_error",
         "claude-nope"),
        ({"model": MODEL, "max_tokens": 4, "messages": USER,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
         "invalid_request_error", "web_search_20250305"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]}, 400,
         "invalid_request_error", "'image'"),
        (b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ],
)  # fmt: skip
async def test_bad_requests_get_anthropics_error_shape(
    server: Server, body: Any, status: int, kind: str, says: str
) -> None:
    response = await raw_post(server, "/v1/messages", body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == kind
    assert says in payload["error"]["message"]


async def test_unknown_fields_are_ignored_and_thinking_blocks_dropped(server: Server) -> None:
    history = [
        *USER,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Blue."}]},
        {"role": "user", "content": [{"type": "text", "text": "Another?"}]},
    ]  # fmt: skip
    body = {"model": MODEL, "max_tokens": 2, "messages": history, "metadata": {"user_id": "u"},
            "service_tier": "auto", "thinking": {"type": "disabled"}}  # fmt: skip
    response = await raw_post(server, "/v1/messages", body)
    assert response.status_code == 200, response.text
    codec = server.service.codec
    turns: Any = [*USER, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another?"}]  # fmt: skip
    assert response.json()["usage"]["input_tokens"] == len(codec.encode(codec.render_chat(turns)))


async def test_the_sdk_raises_typed_errors(server: Server) -> None:
    async with client(server) as c:
        with pytest.raises(anthropic.NotFoundError) as missing:
            await c.messages.create(model="claude-nope", max_tokens=4, messages=USER)
        pipeline = server.service.pipeline
        server.service.set_pipeline(None)
        try:
            with pytest.raises(anthropic.InternalServerError) as loading:
                await c.messages.create(model=MODEL, max_tokens=4, messages=USER)
        finally:
            server.service.set_pipeline(pipeline)
    assert missing.value.status_code == 404
    assert loading.value.status_code == 503
    body: Any = loading.value.body
    assert body["error"]["type"] == "overloaded_error"
    assert loading.value.response.headers["retry-after"]


async def test_the_sdk_lists_and_retrieves_the_model(server: Server) -> None:
    async with client(server) as c:
        page = await c.models.list()
        card = await c.models.retrieve(MODEL)
        with pytest.raises(anthropic.NotFoundError):
            await c.models.retrieve("claude-nope")
    assert [m.id for m in page.data] == [MODEL]
    assert page.has_more is False
    assert card.type == "model"
    assert card.display_name == MODEL
    assert card.created_at == datetime.fromtimestamp(server.service.created, UTC)
    assert card.max_input_tokens == TINY_CONTEXT


async def test_metrics_count_messages_requests(server: Server) -> None:
    async with client(server) as c:
        await c.messages.create(model=MODEL, max_tokens=2, messages=USER)
    requests = server.service.metrics.requests
    assert requests.get(endpoint="messages", outcome="ok") == 1
