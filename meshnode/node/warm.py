"""The first plan of a warm mesh, by the speeds its nodes measured before (issue 34).

Theory of operation. Every node keeps what it measured of itself for a model in its cache
folder (:mod:`meshnode.node.selfmeasure`). Without asking for it, a host brought up again
over the same machines would plan by memory, calibrate the pipeline, and re-place it by
speed before its first request: every stage loading its weights twice. So before it plans,
the host looks up its own cached measurement of the model (:func:`~meshnode.node.
selfmeasure.latest`) and, when it has one, sends each candidate it has not asked yet a
``SpeedQuery`` (only a peer that offers ``speed-query``:
:func:`meshnode.node.wire.for_peer`). A node answers at once from its cache, with no claim
(:func:`~meshnode.node.selfmeasure.speed_report`). Each answer becomes that node's claim
(:meth:`~meshnode.node.claims.ClaimBook.record_cached`), bounded as a prepared node's
report is, and the planner places by speed when every candidate has one. A cold machine
answers that it has nothing: the mesh is planned by memory, calibrated and re-placed as
before.

The same query introduces the workers to each other (issue 34): its ``peers`` name the
other candidates, the node connects to them and measures its links, and answers again with
the same nonce each time it has measured one (:mod:`meshnode.node.links`). So every node is
asked whatever the placement (the links time the hops of a plan by memory too), and asked
again when the candidates grew since; a node's first answer is its claim, a later one
tells only its links, or the claim of a node that had none: a cold node measures itself
when asked (``measuring``, one layer in the background) and answers again when done, so
that a spare node no plan prepares is measured too. :attr:`SpeedQueries.reports` counts
the news (those answers, and the links the host measured itself), which the coordinator
weighs (:mod:`meshnode.node.calibration`, :mod:`meshnode.node.replacing`).

Bounded: each node is asked for its claim once per coordinator; the host waits at most
:data:`QUERY_TIMEOUT_S`, and no longer once every node asked has answered or one has no
usable claim (the plan is by memory then, whatever the others say); a late answer is still
recorded. A cold host waits for nobody. A node that lies earns the layers its lie earns
for one bring-up; calibration and serving then measure it (:mod:`meshnode.node.claims`).
A query names at most ``MAX_REPORTED_LINKS`` peers (what a report may tell the links of).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable
from pathlib import Path

import trio
from meshnode_protocol import SpeedQuery, SpeedReport

from meshnode.engine.backend import Backend
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.claims import ClaimBook
from meshnode.node.links import MAX_REPORTED_LINKS
from meshnode.node.mesh import MeshView
from meshnode.node.planner import NodeCapacity
from meshnode.node.selfmeasure import latest

#: The longest the host waits for the answers before its plan: a node answers from one
#: small file, so a second covers a busy machine; a peer too old to know the query never
#: answers (it is not sent one; the wait is for answers lost with a session).
QUERY_TIMEOUT_S = 1.0


class SpeedQueries:
    """The host's speed queries: whom it asked, and which answered (module docstring)."""

    def __init__(
        self,
        package_ref: str,
        pin: str,
        *,
        backend: Backend,
        cache_dir: Path | None,
        enabled: bool = True,
        timeout_s: float = QUERY_TIMEOUT_S,
    ) -> None:
        self._package_ref, self._pin = package_ref, pin
        self._backend, self._cache_dir = backend, cache_dir
        self._enabled, self._timeout_s = enabled, timeout_s
        self._nonces = itertools.count(1)
        self._asked: dict[str, int] = {}  # node → the nonce of its latest query
        self._told: dict[str, frozenset[str]] = {}  # node → the peers that query named
        self._answered: set[str] = set()
        self._changed = trio.Event()
        self.reports = 0  # link news so far (module docstring)
        self.measuring: set[str] = set()  # nodes whose latest answer: measuring itself
        self._reported = trio.Event()

    def deliver(self, peer: str, report: SpeedReport, claims: ClaimBook) -> bool:
        """A ``SpeedReport`` from ``peer``: its claim when it first answers our latest
        query, its links when it answers it again, and the claim of a node that had none
        (it measured itself when asked); an answer to no query, or to one asked again
        since, is dropped. True: the message was the host's."""
        if self._asked.get(peer) != report.nonce:
            return True
        if peer not in self._answered or (report.decode_us and claims.speed(peer) is None):
            claims.record_cached(peer, report)
            if peer not in self._answered:
                self._answered.add(peer)
                self._changed.set()
        else:
            claims.record_links(peer, report.links)
        if report.measuring:
            self.measuring.add(peer)
        else:
            self.measuring.discard(peer)
        self.links_changed()
        return True

    def unanswered(self) -> set[str]:
        """The nodes asked that have not answered yet (an older peer, never asked, is
        among them too: it does not take the query)."""
        return set(self._asked) - self._answered

    def links_changed(self) -> None:
        """A node told its links, or the host measured one of its own: link news."""
        self.reports += 1
        self._reported.set()
        self._reported = trio.Event()

    def report_event(self) -> trio.Event:
        """The event the next link news sets (take it before reading the links)."""
        return self._reported

    async def ask(self, mesh: MeshView, claims: ClaimBook, nodes: Iterable[NodeCapacity]) -> None:
        """Before a plan over ``nodes``: introduce them to each other (:meth:`introduce`),
        record the host's own cached measurement, and wait boundedly for the claims of
        the nodes asked for the first time."""
        host = mesh.node_id
        new = await self.introduce(mesh, nodes)
        if not self._enabled or not await self._own(host, claims):
            return
        with trio.move_on_after(self._timeout_s if new else 0.0):
            while True:
                self._changed = changed = trio.Event()
                if all(n in self._answered for n in new) or any(
                    n in self._answered and claims.speed(n) is None for n in new
                ):
                    return
                await changed.wait()

    async def introduce(self, mesh: MeshView, nodes: Iterable[NodeCapacity]) -> list[str]:
        """Ask every node of ``nodes`` but the host that was not asked yet, or whose last
        query named fewer of the others than there are now, naming them as its ``peers``;
        the nodes asked for the first time."""
        host = mesh.node_id
        ids = sorted(n.node_id for n in nodes if n.node_id != host)
        first = []
        for node in ids:
            peers = frozenset(ids) - {node}
            if node in self._asked and peers <= self._told[node]:
                continue
            if node not in self._asked:
                first.append(node)
            self._asked[node] = nonce = next(self._nonces)
            self._told[node] = peers
            infos = tuple(mesh.peer_info(p) for p in sorted(peers)[:MAX_REPORTED_LINKS])
            query = SpeedQuery(node_id=host, nonce=nonce, package_ref=self._package_ref,
                               pin=self._pin, peers=infos)  # fmt: skip
            with contextlib.suppress(*SEND_ERRORS):  # no session (or a broken one): no answer
                await mesh.send(node, query)
        return first

    async def _own(self, host: str, claims: ClaimBook) -> bool:
        """Whether the host has a claim, recording its cached measurement if need be."""
        if claims.speed(host) is None:
            model_id = f"{self._package_ref}@{self._pin}"
            found = await trio.to_thread.run_sync(latest, self._cache_dir, model_id, self._backend)
            if found is not None:
                claims.record_own(host, *found)
        return claims.speed(host) is not None
