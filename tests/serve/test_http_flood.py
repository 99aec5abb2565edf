"""A stranger's request flood against ``/metrics`` (issue 36, item 2).

Before, every HTTP method a client invented became a ``meshnode_http_request_duration_seconds``
series, and the request timer sat outside the API guard, so no key was needed: 4,000
requests with random (long) methods made ``/metrics`` 390 MB, the node's RSS grew by a GiB
while it was scraped, and ``/health`` stalled behind the render. Now unknown methods are
labelled ``other`` and only requests the guard lets through are timed.

The server is the node's real app behind hypercorn on loopback, with an API key; the flood
runs in this process, so the RSS measured is the server's (plus the flood's own clients).
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import httpx
import trio

from meshnode.net.http_guard import ApiAccess, HostRule
from meshnode.serve.node_metrics import KNOWN_METHODS, OTHER_LABEL
from meshnode.serve.service import ServeService
from tests.serve.conftest import start_server
from tests.serve.test_metrics_exposition import parse

KEY = "sk-mesh-0123456789abcdef"
#: Requests in the flood, each with a new method of METHOD_CHARS letters: before the fix,
#: 1,200 x ~18 lines x 4 KB made a ~90 MB exposition (h11 takes a method up to its 16 KiB
#: header limit).
FLOOD_REQUESTS = 1_200
METHOD_CHARS = 4_096
#: Concurrent flooding connections.
FLOODERS = 8
#: What one scrape may hold after the flood: every series of a fresh host fits in ~20 KB.
MAX_EXPOSITION_BYTES = 64 << 10
#: Peak RSS growth allowed over the flood (the flood's own clients and buffers included).
MAX_RSS_GROWTH_BYTES = 96 << 20
#: Slowest ``/health`` answer allowed during the flood, with both cores busy elsewhere: the
#: probe waits behind the flood's requests on one event loop, never behind a huge render.
MAX_HEALTH_S = 3.0
REQUEST_TIMEOUT_S = 30.0


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (proc(5)).
    Path("/proc/self/clear_refs").write_text("5")


async def test_a_flood_of_invented_methods_keeps_metrics_and_health_bounded(
    nursery: trio.Nursery, serve_service: ServeService
) -> None:
    server = await start_server(nursery, serve_service, access=ApiAccess(KEY, HostRule.LOOPBACK))
    url = server.base_url
    rng = random.Random(36)
    methods = iter(
        "".join(rng.choices(string.ascii_uppercase, k=METHOD_CHARS)) for _ in range(FLOOD_REQUESTS)
    )
    health_s: list[float] = []
    scrapes: list[int] = []
    flooded = trio.Event()
    keyed = {"authorization": f"Bearer {KEY}"}
    _reset_peak_rss()
    rss_before = _rss_bytes("VmRSS")

    async def flood() -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            for i, method in enumerate(methods):
                # The public probe (answered 405) and a guarded route without the key (401).
                response = await http.request(method, url + ("/health", "/v1/models")[i % 2])
                assert response.status_code in (401, 405), response.status_code

    async def probe(http: httpx.AsyncClient) -> None:
        while not flooded.is_set():
            started = trio.current_time()
            assert (await http.get(url + "/health")).status_code == 200
            health_s.append(trio.current_time() - started)
            scrape = await http.get(url + "/metrics", headers=keyed)
            scrapes.append(len(scrape.content))

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        async with trio.open_nursery() as probes:
            probes.start_soon(probe, http)
            async with trio.open_nursery() as flooders:
                for _ in range(FLOODERS):
                    flooders.start_soon(flood)
            flooded.set()
        final = await http.get(url + "/metrics", headers=keyed)
    growth = _rss_bytes("VmHWM") - rss_before

    latency = parse(final.text)["meshnode_http_request_duration_seconds"]
    labels = [s.labels for s in latency.samples]
    assert {lab["method"] for lab in labels} <= KNOWN_METHODS | {OTHER_LABEL}
    counts = {
        (s.labels["method"], s.labels["route"]): s.value
        for s in latency.samples
        if s.name.endswith("_count")
    }
    assert counts[(OTHER_LABEL, "/health")] >= FLOOD_REQUESTS // 2 - FLOODERS  # let through
    assert not any(route == "/v1/models" for _, route in counts)  # refused: never timed
    assert len(final.content) <= MAX_EXPOSITION_BYTES, len(final.content)
    assert max(scrapes) <= MAX_EXPOSITION_BYTES, max(scrapes)
    assert growth <= MAX_RSS_GROWTH_BYTES, f"peak RSS grew {growth >> 20} MiB"
    assert health_s
    assert max(health_s) <= MAX_HEALTH_S, max(health_s)
