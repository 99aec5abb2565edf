"""Bodies that parse but would have earned a 500 or a retryable 503 (issue 36, item 11).

A 3,000-deep JSON value in an earlier assistant tool call's ``arguments`` raised
``RecursionError`` while the prompt was built: a plain-text 500 on chat (streamed too),
``/tokenize`` and ``/v1/responses``. ``repetition_penalty=1e-308`` (or a temperature as
small) overflowed the logits to ``inf`` and the sampler's NaNs failed the request with a
503 the client retries forever. Each is now a 400 in the API's error shape. NaN or infinite
logprobs from a stage made the reply unencodable (a 500); they now reach the client as
OpenAI writes a token too unlikely to measure, ``-9999.0``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import httpx
import pytest

from meshnode.node.pipeline import Pipeline, RequestId, StepFrame, StepResult, TokenLogprob
from tests.serve.conftest import TINY_MODEL_ID, Server
from tests.serve.test_openai_api import assert_openai_error

REQUEST_TIMEOUT_S = 60.0
#: Deeper than Python's default recursion limit (1,000), as the probe sent.
DEEP = "[" * 3_000 + "]" * 3_000
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
]
DEEP_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": TINY_MODEL_ID, "messages": HISTORY, "max_tokens": 1}),
    (
        "/v1/chat/completions",
        {"model": TINY_MODEL_ID, "messages": HISTORY, "max_tokens": 1, "stream": True},
    ),
    ("/tokenize", {"model": TINY_MODEL_ID, "messages": HISTORY}),
    (
        "/v1/responses",
        {
            "model": TINY_MODEL_ID,
            "max_output_tokens": 1,
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": DEEP},
                {"type": "function_call_output", "call_id": "c", "output": "ok"},
            ],
        },
    ),
]


async def _post(server: Server, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        return await http.post(server.base_url + path, json=body)


@pytest.mark.parametrize(
    ("path", "body"), DEEP_BODIES, ids=["chat", "chat-stream", "tokenize", "responses"]
)
async def test_deeply_nested_tool_arguments_are_a_400(
    server: Server, path: str, body: dict[str, Any]
) -> None:
    error = assert_openai_error(await _post(server, path, body), 400)
    assert "nest" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/responses"])
async def test_a_body_nested_past_the_stack_is_a_400(server: Server, path: str) -> None:
    body = '{"model": "' + TINY_MODEL_ID + '", "messages": ' + DEEP + "}"
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        response = await http.post(
            server.base_url + path, content=body, headers={"content-type": "application/json"}
        )
    assert_openai_error(response, 400)  # FastAPI maps the parser's RecursionError itself


@pytest.mark.parametrize(
    "sampling",
    [{"repetition_penalty": 1e-308}, {"temperature": 1e-308}],
    ids=["tiny-penalty", "tiny-temperature"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_sampling_values_that_overflow_the_logits_are_a_400(
    server: Server, path: str, sampling: dict[str, float]
) -> None:
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi hi hi"}]}
        if path == "/v1/chat/completions"
        else {"prompt": "hi hi hi"}
    )
    body = {"model": TINY_MODEL_ID, **prompt, "max_tokens": 4, **sampling}
    error = assert_openai_error(await _post(server, path, body), 400)
    assert error["param"] == next(iter(sampling))


class PoisonedPipeline:
    """The real pipeline, its logprobs replaced by what a broken or hostile last stage may
    send: NaN, +inf, -inf."""

    POISON = (math.nan, math.inf, -math.inf)

    def __init__(self, inner: Pipeline):
        self.inner = inner

    @property
    def context_size(self) -> int:
        return self.inner.context_size

    async def run(self, frame: StepFrame) -> StepResult:
        result = await self.inner.run(frame)
        poisoned = tuple(
            TokenLogprob(item.token, self.POISON[i % 3], tuple((t, math.nan) for t, _ in item.top))
            for i, item in enumerate(result.logprobs or ())
        )
        return dataclasses.replace(result, logprobs=poisoned or result.logprobs)

    async def release(self, request_id: RequestId) -> None:
        await self.inner.release(request_id)


def _floats(value: Any) -> list[float]:
    """Every float in a JSON value: in a logprobs object, the logprobs (offsets and bytes
    are integers)."""
    if isinstance(value, float):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [f for item in items for f in _floats(item)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stages_non_finite_logprobs_reach_the_client_finite(
    server: Server, path: str, stream: bool
) -> None:
    service = server.service
    real = service.pipeline
    assert real is not None
    service.set_pipeline(PoisonedPipeline(real))
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
        if path == "/v1/chat/completions"
        else {"prompt": "hi", "logprobs": 2}
    )
    # Greedy: a sampled first token may be the end of text, and a one-token reply would
    # carry too few logprobs to show each kind (token, alternatives) made finite.
    body = {"model": TINY_MODEL_ID, **prompt, "max_tokens": 3, "temperature": 0, "stream": stream}
    try:
        response = await _post(server, path, body)
    finally:
        service.set_pipeline(real)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
        documents = [json.loads(event) for event in events]
    else:
        documents = [response.json()]
    values = _floats([choice["logprobs"] for doc in documents for choice in doc["choices"]])
    assert len(values) >= 3 * 3  # each token's logprob and its two alternatives
    assert all(math.isfinite(v) and v <= 0 for v in values), values
