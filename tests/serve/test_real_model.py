"""The real SmolLM2-135M behind the API reproduces the golden greedy outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from meshnode.serve.service import ServeService
from meshnode.serve.single import build_single_node_service
from tests.serve.conftest import Server, start_server

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: Golden continuations are at most 48 tokens (see tests/golden/README.md).
GOLDEN_MAX_TOKENS = 48


@pytest.fixture(scope="module")
def real_service(smollm2_gguf: Path) -> ServeService:
    """The real model, loaded once for the module."""
    return build_single_node_service(str(smollm2_gguf), model_id=MODEL, context_size=512)


@pytest.fixture
async def real_server(nursery: trio.Nursery, real_service: ServeService) -> Server:
    return await start_server(nursery, real_service)


def golden_prompt(golden: dict[str, Any], prompt_id: str) -> dict[str, Any]:
    prompts = golden["prompts"]
    found: dict[str, Any] = next(p for p in prompts if p["id"] == prompt_id)
    return found


def client(server: Server) -> openai.OpenAI:
    """The official client; the tests call it in a worker thread (see tests/serve/conftest)."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


async def test_chat_at_temperature_zero_matches_golden(
    real_server: Server, golden: dict[str, Any]
) -> None:
    case = golden_prompt(golden, "chat_capital")
    reply = await trio.to_thread.run_sync(
        lambda: client(real_server).chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            temperature=0,
            max_tokens=GOLDEN_MAX_TOKENS,
        )
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(case["prompt_ids"])  # template + tokenizer
    assert reply.choices[0].message.content == case["gen_text_skip_special"]
    assert reply.usage.completion_tokens == len(case["gen_ids"])
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("prompt_id", ["chat_python_reverse", "raw_fib"])
async def test_token_id_prompts_stream_the_golden_text(
    real_server: Server, golden: dict[str, Any], prompt_id: str
) -> None:
    case = golden_prompt(golden, prompt_id)

    def stream() -> str:
        chunks = client(real_server).completions.create(
            model=MODEL,
            prompt=case["prompt_ids"],
            temperature=0,
            max_tokens=GOLDEN_MAX_TOKENS,
            stream=True,
        )
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)

    text = await trio.to_thread.run_sync(stream)
    assert text == case["gen_text_skip_special"]
