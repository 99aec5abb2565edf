"""Structured output and forced tool calls with the real SmolLM2-135M and the official client.

Replies are short (a bounded schema, ``max_tokens`` well above what it needs), and
requests that can go together are sent at once, so that continuous batching fuses them:
the module stays within a minute or two of model time on a small CPU. The split-pipeline check is in
tests/e2e/test_split.py (three processes on loopback against this module's reference).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import trio

from meshnode.serve.service import ServeService
from meshnode.serve.single import build_single_node_service
from meshnode.speculative.settings import SpeculativeFlags
from tests.serve.conftest import Server, start_server
from tests.serve.test_openai_api import stream_chat

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
CONTEXT = 1024
CITIES = [
    "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney", "Toronto", "Nairobi",
    "Madrid", "Berlin", "Seoul", "Hanoi", "Dublin", "Lisbon", "Athens", "Vienna", "Quito", "Accra",
]  # fmt: skip
#: A nested schema (objects in an array in an object) with bounded strings and items.
CITY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "landmarks": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "free": {"type": "boolean"},
                },
                "required": ["name", "free"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
CITY_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
#: The schema's replies take 30-60 tokens; the budget only guards against a runaway.
BUDGET = 96
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 40}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


def ask(city: str) -> list[Any]:
    return [{"role": "user", "content": f"Give facts about {city} as JSON."}]


@pytest.fixture(scope="module")
def real_service(smollm2_gguf: Path) -> ServeService:
    return build_single_node_service(str(smollm2_gguf), model_id=MODEL, context_size=CONTEXT)


def _client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300
    )


async def city_json(api: openai.AsyncOpenAI, city: str) -> str:
    reply = await api.chat.completions.create(
        model=MODEL, messages=ask(city), response_format=CITY_FORMAT, max_tokens=BUDGET,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    assert content is not None
    return str(content)


async def city_jsons(service: ServeService, cities: list[str]) -> dict[str, str]:
    """Each city's constrained greedy reply from a server over ``service``, the requests
    sent at once: continuous batching fuses them (up to 8 sequences a forward), and a
    fused sequence gets the tokens it gets alone (tests/node/test_batching.py)."""
    replies: dict[str, str] = {}

    async def one(api: openai.AsyncOpenAI, city: str) -> None:
        replies[city] = await city_json(api, city)

    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, service)
        async with _client(server) as api, trio.open_nursery() as requests:
            for city in cities:
                requests.start_soon(one, api, city)
        nursery.cancel_scope.cancel()
    return replies


@pytest.fixture(scope="module")
def plain_cache() -> dict[str, str]:
    """The twenty cities' replies once the first test below asked for them."""
    return {}


@pytest.fixture
async def plain_replies(real_service: ServeService, plain_cache: dict[str, str]) -> dict[str, str]:
    """The twenty cities' replies, without speculation (computed once for the module)."""
    if not plain_cache:
        plain_cache.update(await city_jsons(real_service, CITIES))
    return plain_cache


async def test_twenty_prompts_give_json_that_validates(plain_replies: dict[str, str]) -> None:
    assert sorted(plain_replies) == sorted(CITIES)
    for reply in plain_replies.values():
        jsonschema.validate(json.loads(reply), CITY)


async def test_speculation_does_not_change_constrained_greedy_replies(
    smollm2_gguf: Path, plain_replies: dict[str, str]
) -> None:
    """With the model as its own (unconstrained) draft, the grammar rejects drafts that
    leave the schema; the replies must still be those of plain decoding."""
    spec_service = build_single_node_service(
        str(smollm2_gguf),
        model_id=MODEL,
        context_size=CONTEXT,
        speculative=SpeculativeFlags(strategy="draft", draft_model=str(smollm2_gguf)),
    )
    cities = CITIES[:2]
    spec = await city_jsons(spec_service, cities)
    assert spec == {city: plain_replies[city] for city in cities}
    status = spec_service.speculation_status()["acceptance"]
    assert 0 < status["accepted"] < status["proposed"]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "search"}}]
)
async def test_forced_tool_calls_parse_validate_and_stream_alike(
    nursery: trio.Nursery, real_service: ServeService, choice: Any
) -> None:
    server = await start_server(nursery, real_service)
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, SEARCH],
        "tool_choice": choice,
        "max_tokens": BUDGET,
        "temperature": 0,
    }
    chunks: list[Any] = []

    async def stream() -> None:
        chunks.extend(await stream_chat(server, **request))

    # Streamed and whole at once: one fused batch.
    async with _client(server) as api, trio.open_nursery() as both:
        both.start_soon(stream)
        reply = await api.chat.completions.create(**request)
    # OpenAI finishes a named choice's call with "stop", any other call with "tool_calls".
    finish = "stop" if isinstance(choice, dict) else "tool_calls"
    assert reply.choices[0].finish_reason == finish
    calls = reply.choices[0].message.tool_calls
    assert calls
    tools = {"get_weather": WEATHER, "search": SEARCH}
    for call in calls:
        schema = tools[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"search"}
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert delta.function is not None
            if delta.id is not None:
                streamed[delta.index] = [delta.function.name or "", ""]
            streamed[delta.index][1] += delta.function.arguments or ""
    expected = {i: [c.function.name, c.function.arguments] for i, c in enumerate(calls)}
    assert streamed == expected
