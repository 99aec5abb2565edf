"""Tools and structured output through the API, on the tiny random model (real tokenizer
and chat template): what reaches the prompt, and what constrained decoding guarantees."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests.serve.conftest import TINY_MODEL_ID, Server
from tests.serve.test_openai_api import client

MODEL = TINY_MODEL_ID
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def api(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client(server) as api:
        yield api


async def _prompt_tokens(api: openai.AsyncOpenAI, **request: Any) -> int:
    reply = await api.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, temperature=0, **request
    )
    assert reply.usage is not None
    return int(reply.usage.prompt_tokens)


async def test_tools_reach_the_prompt_unless_tool_choice_is_none(
    api: openai.AsyncOpenAI,
) -> None:
    plain = await _prompt_tokens(api)
    # SmolLM2's template reads no tools: the Hermes fallback system prompt lists them.
    assert await _prompt_tokens(api, tools=[WEATHER]) > plain + 50
    assert await _prompt_tokens(api, tools=[WEATHER], tool_choice="none") == plain
