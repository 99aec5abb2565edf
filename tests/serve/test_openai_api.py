"""The OpenAI API on a real hypercorn server, driven by the official ``openai`` client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import trio
from meshnode_packaging.sources import open_source
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import Pipeline, RequestId, StepFrame, StepResult
from meshnode.serve.service import ServeService
from meshnode.serve.single import EngineCodec
from tests.serve.conftest import TINY_CONTEXT, TINY_MODEL_ID, Server, start_server, wait_until

MODEL = TINY_MODEL_ID
#: Client-side bound on every request in these tests (seconds).
REQUEST_TIMEOUT_S = 30.0

PROMPTS = [
    "Hello there",
    "The quick brown fox",
    "def main():",
    "Once upon a time",
    "1, 2, 3,",
    "Paris is",
    "<|im_start|>user\nHi<|im_end|>\n",
    "Zebra crossing",
]


def engine_greedy(model_dir: Path, prompt: list[int], max_new: int) -> list[int]:
    """Plain greedy decoding with the engine alone (no serving code), stopping at EOS."""
    source = open_source(model_dir)
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True)
    cache = stage.new_cache(TINY_CONTEXT)
    logits = stage.forward(np.asarray(prompt), 0, cache, out_rows=1)
    out: list[int] = []
    while len(out) < max_new:
        token = int(np.argmax(stage.backend.to_numpy(logits)[-1]))
        out.append(token)
        if token in config.eos_token_ids:
            break
        logits = stage.forward(np.asarray([token]), len(prompt) + len(out) - 1, cache, out_rows=1)
    return out


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


async def stream_chat(server: Server, **request: Any) -> list[ChatCompletionChunk]:
    """The chunks of one streamed chat completion, read by the official sync client in a
    worker thread: openai's async stream stops reading at ``[DONE]`` without closing its
    async generators, which trio reports as a ResourceWarning (an error in this suite)."""

    def read() -> list[ChatCompletionChunk]:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                           max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip
            return list(c.chat.completions.create(stream=True, **request))

    return await trio.to_thread.run_sync(read)


async def stream_completion(server: Server, **request: Any) -> list[Completion]:
    """The chunks of one streamed completion (see ``stream_chat``)."""

    def read() -> list[Completion]:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                           max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:  # fmt: skip
            return list(c.completions.create(stream=True, **request))

    return await trio.to_thread.run_sync(read)


@pytest.fixture
async def api(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official async client, pointed at ``server`` and closed after the test."""
    async with client(server) as c:
        yield c


def tokens_text(service: ServeService, tokens: list[int]) -> str:
    """The reply text for ``tokens``: EOS and other special tokens are not shown."""
    assert isinstance(service.codec, EngineCodec)
    return service.codec.tokenizer.decode(tokens, skip_special=True)


async def test_models_lists_the_served_model(server: Server, api: openai.AsyncOpenAI) -> None:
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_completion_with_token_ids_matches_the_engine(
    server: Server, api: openai.AsyncOpenAI, tiny_model_dir: Path
) -> None:
    prompt = [504, 3575, 282, 4649]
    expected = engine_greedy(tiny_model_dir, prompt, 20)
    reply = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    service = server.service
    assert reply.choices[0].text == tokens_text(service, expected)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].finish_reason == ("stop" if len(expected) < 20 else "length")


async def test_chat_streaming_equals_non_streaming(server: Server, api: openai.AsyncOpenAI) -> None:
    c = api
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    whole = await c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    chunks = await stream_chat(
        server,
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream_options={"include_usage": True},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None
    assert whole.usage is not None
    # The same counts; the streamed request came second and resumed from the cached prefix.
    details = {"prompt_tokens_details"}
    assert usage.model_dump(exclude=details) == whole.usage.model_dump(exclude=details)
    assert usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0
    assert whole.model_extra is not None
    assert whole.model_extra["meshnode"]["speculation"]["windows"] == 0


async def test_eight_concurrent_streams_each_get_the_engine_output(
    server: Server, api: openai.AsyncOpenAI, tiny_model_dir: Path
) -> None:
    service = server.service
    prompts = [service.codec.encode(p) for p in PROMPTS]
    expected = [tokens_text(service, engine_greedy(tiny_model_dir, p, 32)) for p in prompts]
    got = [""] * len(prompts)

    async def stream(index: int) -> None:
        chunks = await stream_completion(
            server, model=MODEL, prompt=prompts[index], max_tokens=32, temperature=0
        )
        got[index] = "".join(ch.choices[0].text for ch in chunks if ch.choices)

    with trio.fail_after(REQUEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for index in range(len(prompts)):
                nursery.start_soon(stream, index)
    assert got == expected
    assert service.pipeline is not None
    assert await wait_until(lambda: server_live(service) == 0)


def server_live(service: ServeService) -> int:
    assert isinstance(service.pipeline, LocalPipeline)
    return service.pipeline.runner.live_sequences


async def test_stop_string_cuts_the_text(server: Server, api: openai.AsyncOpenAI) -> None:
    c = api
    full = await c.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the tiny model's output is too short to pick a stop string"
    cut = await c.completions.create(
        model=MODEL, prompt="Hello", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_seeded_sampling_reproduces(server: Server, api: openai.AsyncOpenAI) -> None:
    c = api

    async def sample(seed: int) -> str | None:
        reply = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=16,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        )
        return reply.choices[0].message.content

    assert await sample(11) == await sample(11)


async def test_logprobs_at_temperature_zero_rank_the_chosen_token_first(
    server: Server, api: openai.AsyncOpenAI
) -> None:
    reply = await api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert reply.usage is not None
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.logprob <= 0


async def test_speculative_greedy_equals_plain_greedy(
    tiny_model_dir: Path, server: Server, api: openai.AsyncOpenAI, nursery: trio.Nursery
) -> None:
    from meshnode.generation.records import Speculation
    from meshnode.serve.single import build_single_node_service
    from meshnode.speculative.ngram import NgramProposer
    from meshnode.speculative.window import WindowPolicy

    spec_service = build_single_node_service(
        str(tiny_model_dir),
        model_id=MODEL,
        context_size=TINY_CONTEXT,
        speculation=Speculation(
            lambda _params, _capacity: NgramProposer(),
            WindowPolicy("adaptive", 3, 1, 6),
            strategy="ngram",
        ),
    )
    spec_server = await start_server(nursery, spec_service)
    # A repetitive prompt, so the n-gram proposer finds drafts to verify.
    prompt = "a b c d a b c d a b c d a b c d a b"
    plain = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    async with client(spec_server) as spec_api:
        spec = await spec_api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0
        )
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.model_extra is not None
    stats = spec.model_extra["meshnode"]["speculation"]
    assert stats["windows"] > 0
    assert stats["strategy"] == "ngram"


# -- errors -------------------------------------------------------------------------------


async def post(server: Server, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        return await http.post(server.base_url + path, json=body)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return dict(error)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "temperature": 3.5}, "temperature"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "n": 2}, "n"),
        ({**CHAT, "tools": [{"type": "retrieval"}]}, "tools"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "seed": 2**64}, "seed"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({**CHAT, "function_call": "auto"}, "function_call"),
    ],
)
async def test_bad_chat_bodies_get_400(server: Server, body: Any, param: str) -> None:
    error = assert_openai_error(await post(server, "/v1/chat/completions", body), 400)
    assert error["param"] == param


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
         "Content parts of type 'image_url' are not supported (only text)."),
        ([{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}],
         "Content parts of type 'input_audio' are not supported (only text)."),
        ([{"type": "text"}], "A text part needs its text."),
        ([{"text": "hi"}], "messages.0.content.0.type: Field required"),
        (5, "messages.0.content: Input should be a valid string"),
    ],
)  # fmt: skip
async def test_content_errors_say_what_is_wrong(server: Server, content: Any, says: str) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": content}]}
    error = assert_openai_error(await post(server, "/v1/chat/completions", body), 400)
    assert error["param"] == "messages"
    assert error["message"] == says


async def test_non_json_body_gets_400(server: Server) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        response = await http.post(
            server.base_url + "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert_openai_error(response, 400)


async def test_a_body_not_labelled_json_gets_400_naming_the_content_type(server: Server) -> None:
    # What `curl -d '{...}'` sends: JSON labelled as a form. Before, the message was
    # pydantic's "body: Input should be a valid dictionary or object to extract fields from".
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        for route in ("/v1/chat/completions", "/tokenize"):
            response = await http.post(
                server.base_url + route,
                content=chat,
                headers={"content-type": "application/x-www-form-urlencoded"},
            )
            assert_openai_error(response, 400)
            message = response.json()["error"]["message"]
            assert "Content-Type: application/json" in message, message
            assert "application/x-www-form-urlencoded" in message, message
        # Labelled JSON but not an object: the message stays pydantic's.
        response = await http.post(
            server.base_url + "/v1/chat/completions",
            content=b"[1]",
            headers={"content-type": "application/json"},
        )
    assert_openai_error(response, 400)
    assert "Content-Type" not in response.json()["error"]["message"]


async def test_bad_completion_prompts_get_400(server: Server) -> None:
    for prompt in (["a", "b"], [10**9], [], [[1], [2]]):
        body = {"model": MODEL, "prompt": prompt}
        assert_openai_error(await post(server, "/v1/completions", body), 400)


async def test_unknown_model_gets_404(server: Server, api: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await api.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        # A lone surrogate is valid JSON (an escape) but not Unicode: no tokenizer takes it.
        (b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        (
            b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": "\\udfff"}',
            "stop",
        ),
    ],
)
async def test_text_that_is_not_unicode_gets_400(server: Server, raw: bytes, param: str) -> None:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        response = await http.post(
            server.base_url + "/v1/chat/completions",
            content=raw % MODEL.encode(),
            headers={"content-type": "application/json"},
        )
    assert assert_openai_error(response, 400)["param"] == param


async def test_oversize_prompt_gets_400_context_length_exceeded(
    server: Server, api: openai.AsyncOpenAI
) -> None:
    body = {"model": MODEL, "prompt": [42] * TINY_CONTEXT}
    error = assert_openai_error(await post(server, "/v1/completions", body), 400)
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # what the official client raises
        await api.completions.create(model=MODEL, prompt=[42] * TINY_CONTEXT)
    assert info.value.code == "context_length_exceeded"


async def test_unknown_fields_are_ignored_and_history_is_accepted(
    server: Server, api: openai.AsyncOpenAI
) -> None:
    history: list[Any] = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "What is 2+2?", "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]  # fmt: skip
    reply = await api.chat.completions.create(
        model=MODEL,
        messages=history,
        max_tokens=4,
        temperature=0,
        seed=-1,
        extra_body={"store": False, "metadata": {"team": "x"}, "frobnicate": True},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_loading_mesh_gets_503_with_retry_after(server: Server) -> None:
    pipeline = server.service.pipeline
    server.service.set_pipeline(None)
    try:
        response = await post(server, "/v1/chat/completions", CHAT)
        assert_openai_error(response, 503)
        assert int(response.headers["retry-after"]) > 0
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            assert (await http.get(server.base_url + "/health")).status_code == 503
    finally:
        server.service.set_pipeline(pipeline)


# -- lifecycle, metrics -------------------------------------------------------------------


class GatedPipeline:
    """The real pipeline, every pass after the first held until cancelled: a stream that
    has sent its first event stays live, however slow the machine, until the server
    notices the client left. ``released`` is set once the sequence was released."""

    def __init__(self, inner: Pipeline):
        self.inner = inner
        self.passes = 0
        self.released = trio.Event()

    @property
    def context_size(self) -> int:
        return self.inner.context_size

    async def run(self, frame: StepFrame) -> StepResult:
        self.passes += 1
        if self.passes > 1:
            await trio.sleep_forever()  # until the disconnect cancels the generation
        return await self.inner.run(frame)

    async def release(self, request_id: RequestId) -> None:
        await self.inner.release(request_id)
        self.released.set()


async def test_client_disconnect_frees_the_sequence(server: Server) -> None:
    service = server.service
    local = service.pipeline
    assert isinstance(local, LocalPipeline)
    gated = GatedPipeline(local)
    service.set_pipeline(gated)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "stream": True, "temperature": 0}

    def read_first_event_then_disconnect() -> tuple[str, int]:
        # The sync client in a worker thread: breaking out of httpx's async line iterator
        # leaves its inner async generators to the garbage collector (a ResourceWarning).
        # The sequence is counted while the line iterator is still open: closing it (as
        # dropping it would) closes the connection.
        with (
            httpx.Client(timeout=REQUEST_TIMEOUT_S) as http,
            http.stream("POST", server.base_url + "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    return line, local.runner.live_sequences
        raise AssertionError("the stream ended without an event")

    first, live = await trio.to_thread.run_sync(read_first_event_then_disconnect)
    assert first.startswith("data: {")
    assert live == 1
    with trio.fail_after(REQUEST_TIMEOUT_S):
        await gated.released.wait()
    assert local.runner.live_sequences == 0
    assert await wait_until(lambda: service.scheduler.in_flight == 0)
    # Generation stopped with the client: the prefill's token is the only one.
    assert service.metrics.generation_tokens.get() == 1
    outcomes = service.metrics.requests.values
    assert outcomes == {(("endpoint", "completions"), ("outcome", "cancelled")): 1.0}


async def test_metrics_and_health(server: Server, api: openai.AsyncOpenAI) -> None:
    c = api
    await c.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        health = await http.get(server.base_url + "/health")
        metrics = await http.get(server.base_url + "/metrics")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'meshnode_requests_total{endpoint="completions",outcome="ok"} 1' in text
    assert "meshnode_generation_tokens_total 4" in text
    assert "meshnode_time_to_first_token_seconds_count 1" in text
    assert "meshnode_stage_compute_seconds_count" in text
    assert "meshnode_wire_seconds_bucket" in text


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (2.0, 0.0), (1.0, 1.0)])
async def test_penalties_match_the_engines_generate(
    server: Server, api: openai.AsyncOpenAI, tiny_model_dir: Path, presence: float, frequency: float
) -> None:
    # Penalties count the generated tokens only, in the API exactly as in the engine's
    # own ladder (prefill, decode one, the engine's sampler over the generated tokens).
    from meshnode.engine.generate import decode_one, prefill
    from meshnode.engine.sampling import Sampler, SamplingParams

    # The tiny model's greedy reply to `start` repeats its 9th token next: ending the prompt
    # there puts the next token in the prompt, so a penalty over the prompt too (not the
    # generated tokens only) changes the reply from its first token.
    start = [504, 3575, 282, 4649]
    prompt = start + engine_greedy(tiny_model_dir, start, 9)
    source = open_source(tiny_model_dir)
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True)
    params = SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)
    sampler, cache = Sampler(params), stage.new_cache(len(prompt) + 24)
    logits = prefill(stage, cache, prompt)
    token_ids: list[int] = []
    while (token := sampler.sample(logits, token_ids)) not in config.eos_token_ids:
        token_ids.append(token)
        if len(token_ids) == 24:
            break
        logits = decode_one(stage, cache, token, len(prompt) + len(token_ids) - 1)
    reply = await api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    assert reply.choices[0].text == tokens_text(server.service, token_ids)
