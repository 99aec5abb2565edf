"""An HTTP soak: many clients, each looping over a random mix of request kinds until a
deadline, every outcome checked against what that kind must get.

Kinds and what each must get (anything else is *unexpected*):

- ``chat`` / ``stream``: a small greedy completion, whole or streamed: 200, or the
  documented 503 (queue full) with ``Retry-After``.
- ``malformed``: a body that is not JSON, or JSON of the wrong shape: 400.
- ``oversized``: a 3 MiB body (cap 2 MiB): 413.
- ``bad-host``: a ``Host`` that is not loopback: 400.
- ``disconnect``: a stream the client drops after its first event (no status to check;
  the server must free the request).
- ``slow-headers``: headers trickled a byte a second: the server closes the connection
  (keep-alive timer) without answering.
- ``slow-body``: a body that stops half-way: 408 once the body deadline passes.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx
import trio

from meshnode.net.address import Address

KINDS = {
    "chat": 30, "stream": 20, "malformed": 10, "oversized": 6, "bad-host": 6,
    "disconnect": 12, "slow-headers": 2, "slow-body": 2,
}  # fmt: skip
EXPECTED: dict[str, set[str]] = {
    "chat": {"200", "503"},
    "stream": {"200", "503"},
    "malformed": {"400"},
    "oversized": {"413"},
    "bad-host": {"400"},
    "disconnect": {"dropped", "503"},
    "slow-headers": {"closed"},
    "slow-body": {"408"},
}
OVERSIZED_BYTES = 3 << 20
#: Seconds any one request may take before the soak calls it hung (the body deadline is
#: 30 s and the keep-alive timer 10 s; a queued greedy request of 8 tokens takes seconds).
REQUEST_TIMEOUT_S = 90.0


@dataclass
class SoakStats:
    """Outcomes by kind, and those no kind allows."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    unexpected: Counter[tuple[str, str]] = field(default_factory=Counter)
    seconds: float = 0.0

    def record(self, kind: str, outcome: str) -> None:
        self.outcomes[kind, outcome] += 1
        if outcome not in EXPECTED[kind]:
            self.unexpected[kind, outcome] += 1

    def table(self) -> str:
        total = sum(self.outcomes.values())
        lines = [f"{total} requests in {self.seconds:.0f} s ({total / self.seconds:.1f}/s)"]
        for (kind, outcome), n in sorted(self.outcomes.items()):
            mark = "  UNEXPECTED" if (kind, outcome) in self.unexpected else ""
            lines.append(f"  {kind:13} {outcome:8} {n:6}{mark}")
        return "\n".join(lines)


def _chat(model: str, stream: bool, max_tokens: int) -> dict[str, object]:
    messages = [{"role": "user", "content": "Name three colours."}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}  # fmt: skip


async def _http(client: httpx.AsyncClient, kind: str, model: str, rng: random.Random) -> str:
    url = "/v1/chat/completions"
    if kind == "chat":
        response = await client.post(url, json=_chat(model, False, 8))
    elif kind == "stream":
        async with client.stream("POST", url, json=_chat(model, True, 8)) as streamed:
            await streamed.aread()
            return str(streamed.status_code)
    elif kind == "malformed":
        bodies = [b"{not json", b"[]", b'{"model": 1}', b'{"messages": "x"}', b"\xff\xfe"]
        headers = {"Content-Type": "application/json"}
        response = await client.post(url, content=rng.choice(bodies), headers=headers)
    elif kind == "oversized":
        body = json.dumps({"model": model, "pad": "x" * OVERSIZED_BYTES}).encode()
        response = await client.post(url, content=body)
    else:  # bad-host
        response = await client.get("/v1/models", headers={"Host": "rebound.example"})
    return str(response.status_code)


async def _disconnect(address: Address, model: str) -> str:
    """A stream the client leaves after its first event, closing the connection."""
    body = json.dumps(_chat(model, True, 64)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream(address.host, address.port)
    async with stream:
        await stream.send_all(head + body)
        received = b""
        while b"data:" not in received:
            chunk = await stream.receive_some()
            if not chunk:
                break
            received += chunk
        status = received.split(b" ", 2)[1].decode() if received else "closed"
    return "dropped" if status == "200" else status


async def _raw(address: Address, kind: str) -> str:
    stream = await trio.open_tcp_stream(address.host, address.port)
    async with stream:
        try:
            if kind == "slow-headers":
                for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n":
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(1.0)
                return "answered-late"
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mod'
            )
            await stream.send_all(head)
            answer = await stream.receive_some()
            return answer.split(b" ", 2)[1].decode() if answer else "closed"
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return "closed"


async def _client(
    address: Address,
    model: str,
    keep_going: Callable[[], bool],
    rng: random.Random,
    stats: SoakStats,
    mix: Mapping[str, int],
) -> None:
    kinds, weights = zip(*mix.items(), strict=True)
    base = f"http://{address}"
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        while keep_going():
            kind = rng.choices(kinds, weights)[0]
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    if kind.startswith("slow"):
                        outcome = await _raw(address, kind)
                    elif kind == "disconnect":
                        outcome = await _disconnect(address, model)
                    else:
                        outcome = await _http(client, kind, model, rng)
            except trio.TooSlowError:
                outcome = "hung"
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            stats.record(kind, outcome)


async def soak(
    address: Address,
    *,
    clients: int,
    seconds: float,
    model: str,
    seed: int,
    mix: Mapping[str, int] = KINDS,
    every_kind_within_s: float | None = None,
) -> SoakStats:
    """Run ``clients`` clients against the API at ``address`` for ``seconds``, each
    choosing its requests' kinds with the weights of ``mix`` (a subset of ``KINDS``); with
    ``every_kind_within_s``, past ``seconds`` until every kind of ``mix`` has been sent
    (a busy machine sends fewer in the time), for at most that long."""
    stats = SoakStats()
    began = time.monotonic()

    def keep_going() -> bool:
        elapsed = time.monotonic() - began
        if elapsed < seconds:
            return True
        sent = {kind for kind, _ in stats.outcomes}
        return (
            every_kind_within_s is not None
            and elapsed < every_kind_within_s
            and not (sent >= set(mix))
        )

    async with trio.open_nursery() as nursery:
        for index in range(clients):
            rng = random.Random(seed * 1000 + index)
            nursery.start_soon(_client, address, model, keep_going, rng, stats, mix)
    stats.seconds = time.monotonic() - began
    return stats


def rss_trend(points: list[tuple[int, int]]) -> float:
    """The least-squares slope of ``(requests served, RSS bytes)`` points, in MiB per 1,000
    requests: a leak per request shows as a steady positive slope, a cache that fills up
    once as a step that the slope over the later points does not carry on."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread  # bytes per request
    return slope * 1000 / 2**20
