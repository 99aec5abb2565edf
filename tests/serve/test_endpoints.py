"""``/tokenize``, ``/detokenize``, ``/v1/models/{id}``, CORS and the 503 message per mesh
state, on a real hypercorn server over the tiny model (real SmolLM2 tokenizer and template).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import trio

from meshnode.node.config import Address
from meshnode.serve.app import create_app, serve_api
from meshnode.serve.availability import unavailable_message
from meshnode.serve.openai_api import mount_openai
from meshnode.serve.service import ServeService
from tests.serve.conftest import TINY_CONTEXT, TINY_MODEL_ID, Server

REQUEST_TIMEOUT_S = 30.0


async def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        return await http.post(server.base_url + path, json=body)


# -- tokenize / detokenize -------------------------------------------------------------------


async def test_tokenize_text_in_vllms_shape(server: Server) -> None:
    codec = server.service.codec
    response = await post(server, "/tokenize", {"model": TINY_MODEL_ID, "prompt": "Hello there"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == codec.encode("Hello there")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == TINY_CONTEXT
    assert body["token_strs"] is None


async def test_tokenize_with_pieces_and_llama_server_names(server: Server) -> None:
    response = await post(server, "/tokenize", {"content": "Paris is", "with_pieces": True})
    body = response.json()
    assert response.status_code == 200, response.text
    assert "".join(body["token_strs"]) == "Paris is"
    assert body["tokens"] == server.service.codec.encode("Paris is", add_special=False)


async def test_tokenize_a_chat_counts_what_a_chat_request_prefills(server: Server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = await post(server, "/tokenize", {"messages": messages})
    expected = server.service.chat_prompt(messages)
    assert response.json()["tokens"] == expected
    # The chat completion's usage counts the same prompt.
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    async with api:
        reply = await api.chat.completions.create(
            model=TINY_MODEL_ID,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=1,
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(expected)


async def test_tokenize_a_chat_without_the_assistants_turn_or_continuing_it(
    server: Server,
) -> None:
    codec = server.service.codec
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    opened = (await post(server, "/tokenize", {"messages": messages})).json()["tokens"]
    closed = await post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert closed.status_code == 200, closed.text
    shut = closed.json()["tokens"]
    # SmolLM2's template opens the assistant's turn with "<|im_start|>assistant\n".
    assert opened[: len(shut)] == shut
    assert codec.decode(opened[len(shut) :]) == "<|im_start|>assistant\n"
    prefill = [*messages, {"role": "assistant", "content": "The answer is"}]
    # add_generation_prompt left out is taken as false here (vLLM would refuse it).
    body = {"messages": prefill, "continue_final_message": True}
    continued = (await post(server, "/tokenize", body)).json()["tokens"]
    assert continued[: len(opened)] == opened
    assert codec.decode(continued[len(opened) :]) == "The answer is"


@pytest.mark.parametrize(
    "extra",
    [
        {"continue_final_message": True, "add_generation_prompt": True},
        {"continue_final_message": True, "add_generation_prompt": False,
         "messages": [{"role": "user", "content": "Hi"}]},
        {"add_generation_prompt": "yes"},
    ],
)  # fmt: skip
async def test_tokenize_refuses_chat_options_that_do_not_fit(
    server: Server, extra: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    response = await post(server, "/tokenize", {"messages": messages, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("continue_final_message", "add_generation_prompt")


@pytest.mark.parametrize(
    "options",
    [{"continue_final_message": True}, {"add_generation_prompt": False}],
    ids=["continue", "unopened"],
)
async def test_chat_completions_take_the_same_template_options(
    server: Server, options: dict[str, Any]
) -> None:
    messages: Any = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My answer is"},
    ]
    counted = await post(server, "/tokenize", {"messages": messages, **options})
    ids = counted.json()["tokens"]
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    async with api:
        chat = await api.chat.completions.create(
            model=TINY_MODEL_ID, messages=messages, max_tokens=4, temperature=0,
            extra_body=options,
        )  # fmt: skip
        text = await api.completions.create(
            model=TINY_MODEL_ID, prompt=ids, max_tokens=4, temperature=0
        )
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(ids)
    # The reply continues exactly that prompt.
    assert chat.choices[0].message.content == text.choices[0].text


async def test_detokenize_round_trips_and_refuses_ids_outside_the_vocab(server: Server) -> None:
    ids = server.service.codec.encode("The quick brown fox", add_special=False)
    response = await post(server, "/detokenize", {"model": TINY_MODEL_ID, "tokens": ids})
    assert response.json() == {"prompt": "The quick brown fox", "content": "The quick brown fox"}
    bad = await post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400,
         "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)  # fmt: skip
async def test_token_routes_refuse_bad_requests_in_openais_shape(
    server: Server, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    response = await post(server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


# -- models ------------------------------------------------------------------------------------


async def test_retrieve_model_by_id_and_404_for_an_unknown_one(server: Server) -> None:
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    async with api:
        card = await api.models.retrieve(TINY_MODEL_ID)
        with pytest.raises(openai.NotFoundError) as caught:
            await api.models.retrieve("no-such-model")
    assert card.id == TINY_MODEL_ID
    assert card.object == "model"
    assert caught.value.code == "model_not_found"


# -- CORS ----------------------------------------------------------------------------------------

ORIGIN = "https://app.example:8443"


async def cors_server(
    nursery: trio.Nursery, service: ServeService, origins: tuple[str, ...]
) -> str:
    app = create_app(lambda: {"node": {"node_id": "test"}}, cors_origins=origins)
    mount_openai(app, service)
    address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
    return f"http://{address}"


PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_cors_allows_the_configured_origin_preflight_included(
    nursery: trio.Nursery, serve_service: ServeService
) -> None:
    base = await cors_server(nursery, serve_service, (ORIGIN,))
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        preflight = await http.options(base + "/v1/chat/completions", headers=PREFLIGHT)
        models = await http.get(base + "/v1/models", headers={"Origin": ORIGIN})
        other = await http.get(base + "/v1/models", headers={"Origin": "https://evil.example"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert models.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in other.headers


async def test_no_cors_headers_without_an_origin_configured(
    nursery: trio.Nursery, serve_service: ServeService
) -> None:
    base = await cors_server(nursery, serve_service, ())
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        preflight = await http.options(base + "/v1/chat/completions", headers=PREFLIGHT)
        models = await http.get(base + "/v1/models", headers={"Origin": ORIGIN})
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in models.headers


# -- 503 per state ---------------------------------------------------------------------------


STAGES = [
    {"state": "ready", "bytes_done": 10, "bytes_total": 10},
    {"state": "preparing", "bytes_done": 5, "bytes_total": 30},
]


@pytest.mark.parametrize(
    ("host", "says"),
    [
        ({"state": "starting"}, "The host is starting"),
        ({"state": "planning", "error": ""}, "planning where the model's layers go"),
        ({"state": "planning", "error": "the model needs 3.1 GiB more"},
         "No plan fits the mesh yet: the model needs 3.1 GiB more. Waiting for more nodes"),
        ({"state": "loading", "stages": STAGES}, "loading the model (1 of 2 stages ready, 37%"),
        ({"state": "loading", "stages": []}, "no stage placed yet"),
        ({"state": "failed", "error": "node b refused the claim"},
         "Bringing up the model failed (node b refused the claim)"),
        ({"state": "failed", "error": "x", "retry_in_s": 4.0},
         "failed (x); the mesh is trying again in 4 s"),
        ({"state": "replanning", "last_failure": "stage node b was lost"},
         "replanning (stage node b was lost)"),
        ({"state": "draining"}, "re-placing the model on the nodes that came back"),
    ],
)  # fmt: skip
def test_each_mesh_state_has_its_own_503_message(host: dict[str, Any], says: str) -> None:
    assert says in unavailable_message(host)


async def test_503_body_and_health_carry_the_state_message(server: Server) -> None:
    pipeline = server.service.pipeline
    server.service.set_pipeline(None)
    reason = "No plan fits the mesh yet: 2 GiB missing. Waiting for more nodes to join."
    server.service.unavailable_reason = lambda: reason
    try:
        response = await post(
            server, "/v1/completions", {"model": TINY_MODEL_ID, "prompt": "Hi", "max_tokens": 2}
        )
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            health = await http.get(server.base_url + "/health")
    finally:
        server.service.set_pipeline(pipeline)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == reason
    assert response.headers["retry-after"]
    assert health.status_code == 503
    assert health.json()["message"] == reason
