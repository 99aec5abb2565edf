"""The model's own sampling defaults fill what a request omits (request > model > OpenAI's),
on a real server over a tiny model whose ``generation_config.json`` asks for greedy."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import trio

from meshnode.engine.sampling import SamplingParams
from meshnode.serve.service import checked_defaults
from meshnode.serve.single import build_single_node_service
from tests.serve.conftest import TINY_CONTEXT, TINY_MODEL_ID, Server, start_server

PROMPT = "Once upon a time"
TOKENS = 12
TRIES = 4


@pytest.fixture(scope="module")
def greedy_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_model_dir, folder)
    defaults = {"temperature": 0.0, "top_k": 1.0, "top_p": 0.0, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(defaults))
    return folder


async def serve(nursery: trio.Nursery, folder: Path) -> Server:
    service = build_single_node_service(
        str(folder), model_id=TINY_MODEL_ID, context_size=TINY_CONTEXT
    )
    return await start_server(nursery, service)


async def texts(server: Server, **request: Any) -> list[str]:
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    async with api:
        replies = [
            await api.completions.create(
                model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=TOKENS, **request
            )
            for _ in range(TRIES)
        ]
    return [r.choices[0].text for r in replies]


async def test_a_request_without_sampling_fields_uses_the_models_defaults(
    nursery: trio.Nursery, greedy_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="meshnode.serve.service"):
        server = await serve(nursery, greedy_model_dir)
    # top_p 0 is no setting (it would keep no token): dropped with a warning, not a 500.
    assert server.service.generation_defaults == {"temperature": 0.0, "top_k": 1}
    assert "ignoring the model's default top_p=0.0" in caplog.text
    greedy = await texts(server, temperature=0)
    omitted = await texts(server)
    assert omitted == greedy
    assert len(set(omitted)) == 1


async def test_fields_the_request_gives_win_over_the_models(
    nursery: trio.Nursery, greedy_model_dir: Path, tiny_model_dir: Path
) -> None:
    server = await serve(nursery, greedy_model_dir)
    # The request's temperature wins, the model's top_k=1 still applies: greedy anyway.
    assert await texts(server, temperature=1.0) == await texts(server, temperature=0)
    # Giving top_k too frees the sampler: seeded samples differ from the greedy reply.
    sampled = await texts(server, temperature=1.0, seed=7, extra_body={"top_k": 0})
    assert sampled[0] != (await texts(server, temperature=0))[0]
    # A model that ships no defaults samples at OpenAI's temperature 1.
    plain = await serve(nursery, tiny_model_dir)
    assert plain.service.generation_defaults == {}
    assert len(set(await texts(plain))) > 1


async def test_the_messages_api_uses_them_too(
    nursery: trio.Nursery, greedy_model_dir: Path
) -> None:
    server = await serve(nursery, greedy_model_dir)
    messages: Any = [{"role": "user", "content": PROMPT}]
    async with anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="unused", max_retries=0
    ) as c:
        replies = [
            await c.messages.create(model=TINY_MODEL_ID, max_tokens=TOKENS, messages=messages)
            for _ in range(TRIES)
        ]
    assert len({r.content[0].model_dump_json() for r in replies}) == 1


def test_checked_defaults_keep_valid_settings_only() -> None:
    raw = {"temperature": 0.7, "top_k": 40.0, "top_p": 1.5, "min_p": "x", "seed": 3,
           "max_new_tokens": 10, "repetition_penalty": 1.1}  # fmt: skip
    kept = checked_defaults(raw)
    assert kept == {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.1}
    SamplingParams(**kept)  # a valid record
