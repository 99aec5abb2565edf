"""Serving on token ids alone: the tiny Qwen 3 reference has no tokenizer.

``return_token_ids`` follows vLLM: each choice carries ``prompt_token_ids`` (the first
chunk when streaming) and ``token_ids`` (its own tokens when streaming).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from meshnode.serve.single import build_single_node_service
from tests.conftest import GOLDEN_DIR
from tests.serve.conftest import Server, start_server

QWEN3_TINY = GOLDEN_DIR / "tiny" / "qwen3-tiny"
MODEL = "qwen3-tiny"
#: Client-side bound on every request in these tests (seconds).
REQUEST_TIMEOUT_S = 30.0


@pytest.fixture
async def qwen3_server(nursery: trio.Nursery) -> Server:
    service = build_single_node_service(str(QWEN3_TINY), model_id=MODEL, context_size=512)
    return await start_server(nursery, service)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((QWEN3_TINY / "golden.json").read_text())
    return data


async def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as http:
        return await http.post(path, json=body)


async def test_token_id_prompts_give_the_reference_tokens(
    qwen3_server: Server, golden: dict[str, Any]
) -> None:
    for prompt in golden["prompts"]:
        body = {
            "model": MODEL,
            "prompt": prompt["prompt_ids"],
            "max_tokens": len(prompt["gen_ids"]),
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = await _post(qwen3_server, "/v1/completions", body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["prompt_token_ids"] == prompt["prompt_ids"]
        assert choice["token_ids"] == prompt["gen_ids"], prompt["id"]
        assert choice["text"] == ""


async def test_streamed_token_ids_add_up(qwen3_server: Server, golden: dict[str, Any]) -> None:
    prompt = golden["prompts"][0]
    body = {
        "model": MODEL,
        "prompt": prompt["prompt_ids"],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    chunks = []
    async with (
        httpx.AsyncClient(base_url=qwen3_server.base_url, timeout=REQUEST_TIMEOUT_S) as http,
        http.stream("POST", "/v1/completions", json=body) as reply,
    ):
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["prompt_token_ids"] == prompt["prompt_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == prompt["gen_ids"][:12]


async def test_without_return_token_ids_the_fields_stay_empty(qwen3_server: Server) -> None:
    body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 3, "temperature": 0}
    choice = (await _post(qwen3_server, "/v1/completions", body)).json()["choices"][0]
    assert choice["token_ids"] is None
    assert choice["prompt_token_ids"] is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hello"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ],
)
async def test_text_without_a_tokenizer_gets_400(
    qwen3_server: Server, path: str, body: dict[str, Any]
) -> None:
    reply = await _post(qwen3_server, path, body)
    assert reply.status_code == 400
    assert "no tokenizer" in reply.json()["error"]["message"]
