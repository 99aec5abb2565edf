"""Admission by KV blocks (issue 30; ``serve.scheduler``, ``ServeService.start``): a CPU
stage's pool holds a few whole contexts, so a request holds the blocks it may write (prompt,
``max_tokens``, a verify pass's drafts) before it runs, waiting in FIFO order for room;
one that no pool can ever hold gets OpenAI's ``context_length_exceeded`` 400 (Anthropic's
``invalid_request_error``)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from meshnode.engine.sampling import SamplingParams
from meshnode.generation.state import GenerationParams
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import PagedPipeline, Pipeline, RequestId, StepFrame, StepResult
from meshnode.node.prefix import pool_blocks
from meshnode.serve.errors import ContextLengthError
from meshnode.serve.scheduler import Scheduler
from meshnode.serve.service import ServeService
from tests.serve.conftest import TINY_CONTEXT, TINY_MODEL_ID, Server

GREEDY = SamplingParams(temperature=0.0)
REQUESTS = 14
#: Generous for the whole concurrent round on two busy cores; the work is ~14 short runs.
ROUND_TIMEOUT_S = 240.0


class Watched:
    """The real pipeline, announcing ``kv_blocks`` (the real one's unless given) and noting,
    at every pass, the blocks the service holds and the requests waiting for some."""

    def __init__(
        self, inner: Pipeline | None, service: ServeService, kv_blocks: int | None = None
    ) -> None:
        assert isinstance(inner, PagedPipeline)
        self.inner, self.service = inner, service
        blocks = inner.kv_blocks if kv_blocks is None else kv_blocks
        assert blocks is not None
        self.kv_blocks: int = blocks
        self.held: list[int] = []
        self.waiting: list[int] = []

    @property
    def context_size(self) -> int:
        return self.inner.context_size

    async def run(self, frame: StepFrame) -> StepResult:
        self.held.append(self.service.scheduler.blocks)
        self.waiting.append(self.service.scheduler.waiting_for_blocks)
        return await self.inner.run(frame)

    async def release(self, request_id: RequestId) -> None:
        await self.inner.release(request_id)


async def _tokens(service: ServeService, prompt: list[int], max_tokens: int | None) -> list[int]:
    run = await service.start(lambda: prompt, GenerationParams(max_tokens, GREEDY))
    await service.complete(run)
    return list(run.state.tokens)


async def test_many_requests_queue_for_blocks_and_each_gets_its_lone_tokens(
    serve_service: ServeService,
) -> None:
    """Random prompt lengths and budgets (some without one: a whole context each), more
    than the pool holds at once: every request waits its turn, the blocks held never pass
    the pool, and each reply equals the same request run alone."""
    local = serve_service.pipeline
    assert isinstance(local, LocalPipeline)
    assert local.kv_blocks == pool_blocks(TINY_CONTEXT, local.runner.max_sequences) - 1
    rng = random.Random(30)
    vocab = serve_service.codec.vocab_size
    jobs = [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randrange(1, TINY_CONTEXT // 2))],
            rng.choice([None, rng.randrange(1, 48)]),
        )
        for _ in range(REQUESTS)
    ]
    want = [await _tokens(serve_service, p, m) for p, m in jobs]  # one at a time
    watched = Watched(local, serve_service)
    serve_service.set_pipeline(watched)
    got: list[list[int]] = [[] for _ in jobs]

    async def one(i: int) -> None:
        got[i] = await _tokens(serve_service, *jobs[i])

    with trio.fail_after(ROUND_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(one, i)
    assert got == want
    assert max(watched.held) <= watched.kv_blocks
    assert max(watched.waiting) > 0  # the pool was short: some request queued for blocks
    assert serve_service.scheduler.blocks == 0


async def test_blocks_are_taken_in_arrival_order_and_given_back() -> None:
    scheduler = Scheduler()
    tickets = [scheduler.enter() for _ in range(3)]
    for ticket in tickets:
        await ticket.acquire()
    order: list[int] = []
    await tickets[0].take_blocks(6, 10)

    async def take(i: int, blocks: int) -> None:
        await tickets[i].take_blocks(blocks, 10)
        order.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, 1, 6)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, 2, 1)  # would fit now, but waits behind the first waiter
        await trio.testing.wait_all_tasks_blocked()
        assert order == []
        assert scheduler.waiting_for_blocks == 2
        tickets[0].release()
    assert order == [1, 2]
    assert scheduler.blocks == 7
    with pytest.raises(ValueError, match="cannot take"):
        await tickets[1].take_blocks(1, 10)  # it holds blocks already
    for ticket in tickets:
        ticket.release()
        ticket.release()  # idempotent
    assert scheduler.blocks == 0
    assert scheduler.in_flight == 0
    late = scheduler.enter()
    await late.acquire()
    with pytest.raises(ValueError, match="cannot take"):
        await late.take_blocks(11, 10)  # more than the pool: the service refuses it first
    late.release()


async def test_a_request_no_pool_holds_is_refused_and_frees_its_slot(
    serve_service: ServeService,
) -> None:
    watched = Watched(serve_service.pipeline, serve_service, kv_blocks=2)  # 64 positions
    serve_service.set_pipeline(watched)
    with pytest.raises(ContextLengthError, match="KV pool holds 64"):
        await serve_service.start(lambda: [5] * 40, GenerationParams(40, GREEDY))
    assert serve_service.scheduler.in_flight == 0
    assert serve_service.scheduler.blocks == 0
    assert await _tokens(serve_service, [5] * 10, 4)  # one that fits runs


async def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60.0) as http:
        return await http.post(server.base_url + path, json=body)


LONG = [{"role": "user", "content": "Name a colour. " * TINY_CONTEXT}]


@pytest.mark.parametrize("pool", [False, True])
async def test_both_apis_answer_400_for_a_request_that_can_never_fit(
    server: Server, pool: bool
) -> None:
    """Without ``pool``: a prompt longer than the context; with it: a short prompt whose
    ``max_tokens`` no stage's pool (of two blocks here) can hold."""
    service = server.service
    if pool:
        service.set_pipeline(Watched(service.pipeline, service, kv_blocks=2))
    messages = [{"role": "user", "content": "Name a colour."}] if pool else LONG
    says = "KV pool" if pool else "maximum context length"
    body = {"model": TINY_MODEL_ID, "messages": messages, "max_tokens": 100}
    openai = await _post(server, "/v1/chat/completions", body)
    assert openai.status_code == 400, openai.text
    assert openai.json()["error"]["code"] == "context_length_exceeded"
    assert says in openai.json()["error"]["message"]
    anthropic = await _post(server, "/v1/messages", body)
    assert anthropic.status_code == 400, anthropic.text
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert says in anthropic.json()["error"]["message"]
    assert service.scheduler.in_flight == 0
