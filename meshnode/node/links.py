"""Link bandwidth: each node times a bounded probe to each peer over their session (issue 34).

Theory of operation. A hop of the pipeline costs its round trip plus the activation bytes
it carries over the link's rate: a few KiB a decode token, but a prefill chunk carries
hundreds of rows, and a Wi-Fi link of a few MB/s makes that the larger part. The
heartbeat measures the round trip (:mod:`meshnode.node.sessions`); this module the rate.

Once a session is up, its node sends the peer an empty ``LinkProbe``, then one of
``PROBE_BYTES`` of padding, each answered at once by a ``LinkProbeReply``; the rate is the
padding over the difference of the two answers' times (:func:`link_rate`), so the round
trip cancels out. The result is kept for the session (:class:`LinkBook`) and measured
again once it is ``LINK_MAX_AGE_S`` old. A probe starts only while no request passes
through the node (``quiet``: a node that prepares or holds an idle stage is quiet), so it
never shares the link with a request's activations; a link that is due while the node
serves waits for a gap between requests, looked for every ``QUIET_RECHECK_S``. The
planner counts the rate in each hop (:func:`meshnode.node.planner.hop_seconds`).

A worker tells the host what it measured of its own links (rates and the heartbeat's round
trips, :func:`reported_links`) in its ``InventoryReport`` and ``SpeedReport``: the host
times the hop between two workers' stages by them (claims: :mod:`meshnode.node.claims`).
Two workers that joined through the host need not know each other: the host's
``SpeedQuery`` names the other candidates (``peers``), the worker connects to them, and
each link it then measures is told to the host at once, in a new ``SpeedReport``
(``measured``: :mod:`meshnode.node.warm`), so that the host can place the workers by
the links between them before its API opens (:func:`unmeasured_links`,
:mod:`meshnode.node.calibration`).

The peer is not trusted: it can answer late (its link then looks slow: it only loses
layers), or answer before the padding arrived (its link looks fast, up to
``MAX_LINK_BYTES_PER_S``: a plan that overrates one hop, never a broken run). It can send
probes of its own: a node answers ``PROBE_ANSWER_BURST`` of them per peer, then one per
``PROBE_ANSWER_EVERY_S``, and drops the rest unanswered (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from meshnode_protocol import (
    DTYPE_SIZES,
    LinkProbe,
    LinkProbeReply,
    Message,
    PeerLink,
    Tensor,
)

from meshnode.engine.config import ModelConfig
from meshnode.net.limits import TokenBuckets
from meshnode.node.planner import ModelFootprint, NodeCapacity, hop_link, hop_seconds

log = logging.getLogger("meshnode.node")

# The padding of the timed probe: 256 KiB crosses a 100 Mbit/s link in ~20 ms and a
# 10 Mbit/s Wi-Fi link in ~0.2 s, long beside a LAN's round trip (under 1 ms) and a
# scheduler's noise, yet once a session it costs nothing a user would see.
PROBE_BYTES = 256 * 1024
# A probe (both round trips) not answered within this is abandoned: the link stays
# unmeasured (hop = round trip alone). 256 KiB at 100 kB/s takes under 3 s.
PROBE_TIMEOUT_S = 10.0
# Measured again once this old, while the node serves no run (a Wi-Fi link changes).
LINK_MAX_AGE_S = 600.0
# The fastest link believed: 100 Gbit/s. A peer that answers before the padding arrived
# makes its link look as fast as this, not infinitely fast.
MAX_LINK_BYTES_PER_S = 12.5e9
# The shortest difference of the two round trips taken as a measurement (the clock's and
# the scheduler's resolution): below it the rate is the cap.
_MIN_TRANSFER_S = PROBE_BYTES / MAX_LINK_BYTES_PER_S
# Probes a node answers per peer at once, then one per PROBE_ANSWER_EVERY_S: a session
# probes twice at its start and again every LINK_MAX_AGE_S.
PROBE_ANSWER_BURST = 4
PROBE_ANSWER_EVERY_S = 30.0
# How often a session looks whether its link is due to be measured again (a minute: a
# measure's age limit, LINK_MAX_AGE_S, is ten).
LINK_RECHECK_S = 60.0
# How often a due link looks again for a moment when no request passes through the node:
# a chat's request lasts seconds, and a probe that waits a second more for the gap after
# it costs nothing, where one sent beside a request's activations would slow its tokens.
QUIET_RECHECK_S = 1.0
# The prefill chunk whose hop the status shows: the default ``[model] prefill_chunk_tokens``.
STATUS_PREFILL_ROWS = 256
# Links a node tells of itself in a report (InventoryReport/SpeedReport ``links``): a home
# mesh has a handful of peers; 64 is far more and keeps a report a few KiB.
MAX_REPORTED_LINKS = 64


def link_rate(probe_bytes: int, empty_s: float, padded_s: float) -> float:
    """The link's rate in bytes a second: ``probe_bytes`` of padding over the time the
    padded probe's answer took beyond the empty one's, at most ``MAX_LINK_BYTES_PER_S``
    (a padded probe answered as fast as the empty one: the link's rate is past what a
    probe this size can tell)."""
    transfer = padded_s - empty_s
    if not transfer > _MIN_TRANSFER_S:  # NaN too
        return MAX_LINK_BYTES_PER_S
    return min(probe_bytes / transfer, MAX_LINK_BYTES_PER_S)


def padding(nbytes: int) -> Tensor:
    """A probe's payload of ``nbytes`` (even) zero bytes."""
    return Tensor(dtype="f16", shape=(nbytes // 2,), data=bytes(nbytes - nbytes % 2))


@dataclass(frozen=True, slots=True)
class LinkRate:
    """A link's measured rate (bytes a second) and when it was measured (trio time)."""

    bytes_per_s: float
    measured_at: float


Send = Callable[[Message], Awaitable[None]]


class LinkBook:
    """This node's measured links to its peers, and the probes waiting for an answer;
    ``quiet()``: whether no request passes through the node (a probe may start);
    ``measured(peer)``: told after each measurement (the node tells its host)."""

    def __init__(
        self,
        node_id: str,
        *,
        quiet: Callable[[], bool] = lambda: True,
        measured: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.node_id = node_id
        self._quiet, self._measured = quiet, measured
        self.rates: dict[str, LinkRate] = {}
        self._waiting: dict[tuple[str, int], trio.Event] = {}
        self._nonces = itertools.count(1)
        self._answers = TokenBuckets(burst=PROBE_ANSWER_BURST, per_s=1 / PROBE_ANSWER_EVERY_S)

    def rate(self, peer: str) -> float:
        """The link's rate to ``peer`` in bytes a second; 0.0 when not measured."""
        link = self.rates.get(peer)
        return 0.0 if link is None else link.bytes_per_s

    def due(self, peer: str, now: float) -> bool:
        """Whether the link to ``peer`` is unmeasured or ``LINK_MAX_AGE_S`` old."""
        link = self.rates.get(peer)
        return link is None or now - link.measured_at >= LINK_MAX_AGE_S

    def forget(self, peer: str) -> None:
        """The session with ``peer`` ended: its next session measures again."""
        self.rates.pop(peer, None)

    async def measure(self, peer: str, send: Send) -> float | None:
        """Time an empty and a padded probe to ``peer`` (``send``: over its session) and
        keep the rate; None when they were not answered within ``PROBE_TIMEOUT_S``."""
        with trio.move_on_after(PROBE_TIMEOUT_S):
            empty = await self._round_trip(peer, send, 0)
            padded = await self._round_trip(peer, send, PROBE_BYTES)
            rate = link_rate(PROBE_BYTES, empty, padded)
            self.rates[peer] = LinkRate(rate, trio.current_time())
            log.debug("link to %s: %.1f MB/s", peer, rate / 1e6)
            return rate
        log.info("link probe to %s not answered within %.0f s", peer, PROBE_TIMEOUT_S)
        return None

    async def _round_trip(self, peer: str, send: Send, nbytes: int) -> float:
        nonce = next(self._nonces)
        answered = self._waiting[peer, nonce] = trio.Event()
        try:
            start = trio.current_time()
            payload = padding(nbytes) if nbytes else None
            await send(LinkProbe(node_id=self.node_id, nonce=nonce, payload=payload))
            await answered.wait()
            return trio.current_time() - start
        finally:
            del self._waiting[peer, nonce]

    async def keep_measured(self, peer: str, send: Send) -> None:
        """Measure the link to ``peer`` now, then again whenever it is due, looking every
        ``LINK_RECHECK_S``; a due link waits for the node to be quiet, looked at every
        ``QUIET_RECHECK_S``; each measurement is told (``measured``). Until cancelled."""
        while True:
            if not self.due(peer, trio.current_time()):
                await trio.sleep(LINK_RECHECK_S)
            elif not self._quiet():
                await trio.sleep(QUIET_RECHECK_S)
            elif await self.measure(peer, send) is None:
                await trio.sleep(LINK_RECHECK_S)  # not answered: try again later
            elif self._measured is not None:
                await self._measured(peer)

    def receive(
        self, peer: str, message: LinkProbe | LinkProbeReply, now: float
    ) -> LinkProbeReply | None:
        """Take ``peer``'s probe or answer; what to send it back (an answer), if anything."""
        if isinstance(message, LinkProbe):
            return self.answer(peer, message, now)
        self.answered(peer, message)
        return None

    def answered(self, peer: str, reply: LinkProbeReply) -> None:
        """``peer`` answered a probe; an answer to none of ours is dropped."""
        event = self._waiting.get((peer, reply.nonce))
        if event is not None:
            event.set()

    def answer(self, peer: str, probe: LinkProbe, now: float) -> LinkProbeReply | None:
        """The answer to ``peer``'s probe, or None once it has sent more than it may."""
        if self._answers.allow(peer, now) is None:
            return None
        size = 0 if probe.payload is None else probe.payload.nbytes
        return LinkProbeReply(node_id=self.node_id, nonce=probe.nonce, received_bytes=size)


def reported_links(
    peers: Iterable[tuple[str, float | None]], book: LinkBook
) -> tuple[PeerLink, ...]:
    """This node's links to ``peers`` (node id and the heartbeat's round trip, None while
    unknown) as its reports tell them, with the rates ``book`` measured; a link with
    neither figure is left out, and all past ``MAX_REPORTED_LINKS``."""
    links = []
    for node_id, rtt_s in peers:
        rate = book.rate(node_id)
        if rtt_s or rate:
            links.append(PeerLink(node_id=node_id, rtt_us=(rtt_s or 0.0) * 1e6, bytes_per_s=rate))
    return tuple(links[:MAX_REPORTED_LINKS])


def unmeasured_links(nodes: Sequence[NodeCapacity], host_id: str) -> list[tuple[str, str]]:
    """The links between two workers of ``nodes`` that both tell their links (a node that
    reported none does not probe) whose rate neither reported, as pairs of node ids in
    the order of ``nodes``. The hop over such a link counts the host's link to the later
    node (:func:`~meshnode.node.planner.hop_link`). The host's own links are not counted:
    it measures them as its sessions start, before it plans."""
    telling = [node for node in nodes if node.node_id != host_id and node.links]

    def rate(node: NodeCapacity, peer: NodeCapacity) -> float:
        return next((x.bytes_per_s for x in node.links if x.node_id == peer.node_id), 0.0)

    return [
        (a.node_id, b.node_id)
        for a, b in itertools.combinations(telling, 2)
        if not (rate(a, b) or rate(b, a))
    ]


def with_hop_bytes(model: ModelFootprint, config: ModelConfig, wire_dtype: str) -> ModelFootprint:
    """``model`` with what a hop carries a token: one row of activations (the model's hidden
    size) at the wire dtype, the bytes the planner's hop time counts over a link."""
    activations = config.hidden_size * DTYPE_SIZES[wire_dtype]
    return dataclasses.replace(model, activation_bytes_per_token=activations)


def link_status(
    model: ModelFootprint, node: NodeCapacity, prefill_rows: int, after: NodeCapacity | None = None
) -> dict[str, Any]:
    """A stage's hop as the status shows it: the measured rate of the link into ``node``
    from ``after``'s stage (None: the host's; :func:`~meshnode.node.planner.hop_link`) in
    MB/s, null until measured, and the hop's time for a decode token and for a prefill
    chunk of ``prefill_rows`` rows, in ms (:func:`~meshnode.node.planner.hop_seconds`)."""
    return {
        "link_mbytes_per_s": round(hop_link(node, after)[1] / 1e6, 3) or None,
        "hop_ms": round(hop_seconds(model, node, after=after) * 1e3, 3),
        "prefill_hop_ms": round(hop_seconds(model, node, prefill_rows, after=after) * 1e3, 3),
    }
