"""Tools and structured output through the API, on the tiny random model (real tokenizer
and chat template): what reaches the prompt, and what constrained decoding guarantees."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import trio

from meshnode.serve.single import build_single_node_service
from meshnode.speculative.settings import SpeculativeFlags
from tests.serve.conftest import TINY_CONTEXT, TINY_MODEL_ID, Server, start_server
from tests.serve.test_openai_api import assert_openai_error, client, post, stream_chat

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


#: Context for the tool-call tests: the fallback prompt listing two tools is ~270 tokens,
#: more than the shared tiny service's context; the tiny model allows 512 positions.
TOOLS_CONTEXT = 512


@pytest.fixture
async def api(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client(server) as api:
        yield api


@pytest.fixture
async def tools_server(tiny_model_dir: Path, nursery: trio.Nursery) -> Server:
    service = build_single_node_service(
        str(tiny_model_dir), model_id=MODEL, context_size=TOOLS_CONTEXT
    )
    return await start_server(nursery, service)


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


# -- constrained decoding ----------------------------------------------------------------

#: A nested schema whose every reply is bounded (short strings, few items), so that even a
#: random model at temperature 1 closes it within the token budget.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog"]},
                    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                },
                "required": ["kind", "tags"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PERSON_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}, "hours": {"type": "boolean"}},
            "required": ["zone", "hours"],
            "additionalProperties": False,
        },
    },
}
#: Completion tokens of a constrained reply: the schemas above close well within them.
BUDGET = 160


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 1), (1.0, 2)])
async def test_json_schema_replies_follow_the_schema(
    api: openai.AsyncOpenAI, temperature: float, seed: int | None
) -> None:
    reply = await api.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=PERSON_FORMAT,
        max_tokens=BUDGET,
        temperature=temperature,
        seed=seed,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PERSON)


async def test_json_object_replies_are_objects(api: openai.AsyncOpenAI) -> None:
    reply = await api.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=BUDGET,
        temperature=0,
    )
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":  # a random model may write a long object
        assert content is not None
        assert isinstance(json.loads(content), dict)
    else:
        assert content is not None
        assert content.startswith("{")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"$ref": "#/nowhere"}}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "integer", "minimum": "low"}}}], "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
async def test_schemas_that_do_not_compile_are_400(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": ASK, **extra}
    error = assert_openai_error(await post(server, "/v1/chat/completions", body), 400)
    assert error["param"] == param


# -- other servers' constraint fields ------------------------------------------------------

CODE = r"[0-9]{3}-[a-c]{2}"
GBNF = 'root ::= "yes" | "no" | "maybe"'
LARK = 'start: "yes" | "no" | "maybe"'


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"guided_regex": CODE}, lambda t: re.fullmatch(CODE, t)),
        ({"guided_grammar": GBNF}, lambda t: t in ("yes", "no", "maybe")),
        ({"grammar": LARK}, lambda t: t in ("yes", "no", "maybe")),
        ({"structured_outputs": {"choice": ["on", "off"]}}, lambda t: t in ("on", "off")),
        ({"structured_outputs": {"regex": CODE}}, lambda t: re.fullmatch(CODE, t)),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"guided_json": json.dumps(PERSON)},
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"json_schema": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"structured_outputs": {"json": PERSON}},
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        # Any object: a random model may write one longer than the budget (see above).
        ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith("{")),
        ({"response_format": PERSON_FORMAT},
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["chat", "text"])
async def test_vllm_and_llama_server_constraints_are_enforced(
    api: openai.AsyncOpenAI, extra: dict[str, Any], check: Any, endpoint: str
) -> None:
    """A random model at temperature 1 writes what the constraint allows, on both routes."""
    if endpoint == "chat":
        reply = await api.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=BUDGET, temperature=1.0, seed=3,
            extra_body=extra,
        )  # fmt: skip
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    else:
        done = await api.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=BUDGET, temperature=1.0, seed=3,
            extra_body=extra,
        )  # fmt: skip
        text, finish = done.choices[0].text, done.choices[0].finish_reason
    assert finish == "stop" or "json_object" in str(extra)
    assert text is not None
    assert check(text), text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"json": {"type": "x"}}}, "structured_outputs.json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
async def test_constraints_that_do_not_compile_or_collide_are_400(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL, "messages": ASK, **extra}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", **extra}),
    ):
        error = assert_openai_error(await post(server, path, body), 400)
        assert error["param"] == param, (path, error)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
async def test_forced_tool_calls_are_valid_and_stream_the_same(
    tools_server: Server, choice: Any
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_tokens": BUDGET,
        "temperature": 0,
    }
    async with client(tools_server) as api:
        reply = await api.chat.completions.create(**request)
    choice_out = reply.choices[0]
    # OpenAI finishes a named choice's call with "stop", any other call with "tool_calls".
    finish = "stop" if isinstance(choice, dict) else "tool_calls"
    assert choice_out.finish_reason == finish
    assert choice_out.message.content is None
    calls = choice_out.message.tool_calls
    assert calls is not None
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    chunks = await stream_chat(tools_server, **request)
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                assert delta.function is not None
                assert delta.function.name is not None
                streamed[delta.index] = [delta.function.name, ""]
            assert delta.function is not None
            streamed[delta.index][1] += delta.function.arguments or ""
    assert streamed == {0: [call.function.name, call.function.arguments]}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish


async def test_constrained_greedy_is_the_same_with_speculation(
    tiny_model_dir: Path, api: openai.AsyncOpenAI, nursery: trio.Nursery
) -> None:
    """The draft is the model itself, unconstrained: its drafts leave the schema often, so
    the grammar rejects some of them, and the reply must still be plain decoding's."""
    spec_service = build_single_node_service(
        str(tiny_model_dir),
        model_id=MODEL,
        context_size=TINY_CONTEXT,
        speculative=SpeculativeFlags(strategy="draft", draft_model=str(tiny_model_dir)),
    )
    spec_server = await start_server(nursery, spec_service)
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "response_format": PERSON_FORMAT,
        "max_tokens": BUDGET,
        "temperature": 0,
    }
    plain = await api.chat.completions.create(**request)
    async with client(spec_server) as spec_api:
        spec = await spec_api.chat.completions.create(**request)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra is not None
    stats = spec.model_extra["meshnode"]["speculation"]
    assert stats["strategy"] == "draft"
    assert 0 < stats["accepted"] < stats["proposed"]  # drafts were verified, some rejected
