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

Bounded: each node is asked once per coordinator; the host waits at most
:data:`QUERY_TIMEOUT_S`, and no longer once every node asked has answered or one has no
usable claim (the plan is by memory then, whatever the others say); a late answer is still
recorded. A cold host asks nobody. A node that lies earns the layers its lie earns for one
bring-up; calibration and serving then measure it (:mod:`meshnode.node.claims`).
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
        self._asked: dict[str, int] = {}  # node → the nonce of its query
        self._answered: set[str] = set()
        self._changed = trio.Event()

    def deliver(self, peer: str, report: SpeedReport, claims: ClaimBook) -> bool:
        """A ``SpeedReport`` from ``peer``: its claim when it answers our query (an answer
        to no query, or a second one, is dropped). True: the message was the host's."""
        if self._asked.get(peer) == report.nonce and peer not in self._answered:
            self._answered.add(peer)
            claims.record_cached(peer, report)
            self._changed.set()
        return True

    async def ask(self, mesh: MeshView, claims: ClaimBook, nodes: Iterable[NodeCapacity]) -> None:
        """Before a plan over ``nodes``: record the host's own cached measurement, and ask
        every other node not asked yet for its own, waiting boundedly for the answers."""
        host = mesh.node_id
        if not self._enabled or not await self._own(host, claims):
            return
        new = [n.node_id for n in nodes if n.node_id != host and n.node_id not in self._asked]
        for node in new:
            self._asked[node] = nonce = next(self._nonces)
            query = SpeedQuery(node_id=host, nonce=nonce, package_ref=self._package_ref,
                               pin=self._pin)  # fmt: skip
            with contextlib.suppress(*SEND_ERRORS):  # no session (or a broken one): no answer
                await mesh.send(node, query)
        with trio.move_on_after(self._timeout_s if new else 0.0):
            while True:
                self._changed = changed = trio.Event()
                if all(n in self._answered for n in new) or any(
                    n in self._answered and claims.speed(n) is None for n in new
                ):
                    return
                await changed.wait()

    async def _own(self, host: str, claims: ClaimBook) -> bool:
        """Whether the host has a claim, recording its cached measurement if need be."""
        if claims.speed(host) is None:
            model_id = f"{self._package_ref}@{self._pin}"
            found = await trio.to_thread.run_sync(latest, self._cache_dir, model_id, self._backend)
            if found is not None:
                claims.record_own(host, *found)
        return claims.speed(host) is not None
