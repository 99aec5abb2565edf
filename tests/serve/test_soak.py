"""The HTTP soak, small enough for the default run: a handful of clients for a few seconds
against the API over the tiny model (the reliability suite, ``pytest -m reliability``, runs
64 clients for minutes against a two-stage mesh serving a real model).

Every kind of request but the slow header trickle (which needs the 10 s keep-alive timer)
is in the mix, with equal weights; the body deadline is cut to one second so that a body
that stops half-way gets its 408 inside the soak.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import trio

from meshnode.net.http_guard import BodyLimits
from meshnode.serve.service import ServeService
from tests.reliability.soak import KINDS, rss_trend, soak
from tests.serve.conftest import TINY_MODEL_ID, start_server, wait_until

CLIENTS = 6
SECONDS = 4.0
# With both cores busy, 4 s may not send every kind: the soak goes on until it has, this long
# at most.
EVERY_KIND_WITHIN_S = 120.0
MIX = {kind: 1 for kind in KINDS if kind != "slow-headers"}


async def test_a_short_soak_gets_only_documented_answers(
    nursery: trio.Nursery, serve_service: ServeService, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_server(nursery, serve_service, limits=BodyLimits(timeout_s=1.0))
    stats = await soak(
        server.address, clients=CLIENTS, seconds=SECONDS, model=TINY_MODEL_ID, seed=3, mix=MIX,
        every_kind_within_s=EVERY_KIND_WITHIN_S,
    )  # fmt: skip
    print(stats.table())
    assert stats.unexpected == Counter(), stats.table()
    assert {kind for kind, _ in stats.outcomes} == set(MIX), stats.table()
    # No request, however it ended, raised inside the server (hypercorn logs those).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    # Nothing is left held: every request, dropped streams included, gave its slot back.
    assert await wait_until(lambda: serve_service.scheduler.in_flight == 0)
    assert serve_service.scheduler.waiting == 0
    assert serve_service.open_runs == 0


def test_the_rss_trend_tells_a_leak_from_a_step() -> None:
    mib = 2**20
    # 1 KiB per request: a leak, 0.98 MiB per 1,000 requests whatever the starting size.
    leak = [(n, 400 * mib + n * 1024) for n in (100, 400, 700, 1000)]
    assert abs(rss_trend(leak) - 1000 * 1024 / mib) < 1e-9
    # A cache that filled once, then flat: nothing after the step.
    assert rss_trend([(400, 455 * mib), (700, 455 * mib), (1000, 455 * mib)]) == 0.0
    assert rss_trend([(400, 455 * mib)]) == 0.0
