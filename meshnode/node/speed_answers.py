"""A node's answers to a host's ``SpeedQuery`` (issue 34): its cached measurement of the
model and its links, and again each time a link (or the node itself) is measured.

Theory of operation. A host asks every candidate before it plans (:mod:`meshnode.node.warm`).
The node answers at once from its cache, without a claim (:func:`~meshnode.node.selfmeasure.
speed_report`), and connects to the peers the query names (``meet``), so that it measures
its links to them (:mod:`meshnode.node.links`). It keeps the latest query and its host, and
answers it again, with the same nonce, each time a link is measured
(:meth:`SpeedAnswers.link_measured`): the host learns the links between its workers while
they prepare, in time to place them by those links.

A node with no measurement of the model (``measure_when_asked``, as the daemon is) answers
that it is ``measuring`` itself and, unless a plan claims it within :data:`SPARE_AFTER_S`
(its ``Prepare`` measures it then), fetches the model's first layer into its cache as a
``Prepare`` would, times it (:func:`~meshnode.node.selfmeasure.measure_or_reason`) and
answers again: a spare node that no plan prepared can then be placed by speed. One
measurement runs at a time on a node (:attr:`SpeedAnswers.measure_lock`, which a
``Prepare``'s takes too: two at once would time each other), and a node measures itself
when asked for at most :data:`MAX_ASKED_MODELS` models in its life: any member may send
queries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import trio
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref
from meshnode_protocol import Message, PeerInfo, PeerLink, SpeedQuery

from meshnode.engine.backend import Backend
from meshnode.net.stream import SEND_ERRORS
from meshnode.node.peer_models import PeerModels
from meshnode.node.selfmeasure import SelfMeasure, measure_or_reason, speed_report

log = logging.getLogger("meshnode.worker")

#: A cold node asked for its speed measures itself only if no plan claims it within this:
#: a claimed node's Prepare measures it (two measurements would cost its bring-up seconds),
#: and the host claims right after the plan its query preceded (it waits at most
#: warm.QUERY_TIMEOUT_S, 1 s, for the answers); 5 s leave room for a loaded machine.
SPARE_AFTER_S = 5.0
#: Models a node measures itself for when asked, over its life, one at a time: a home mesh
#: serves a handful, and any member may send queries (each names a model to fetch a layer
#: of), so a member asking for many cannot keep the node fetching and timing.
MAX_ASKED_MODELS = 4


class SpeedAnswers:
    """This node's answers to the latest ``SpeedQuery`` (module docstring)."""

    def __init__(
        self,
        node_id: str,
        send: Callable[[str, Message], Awaitable[None]],
        *,
        backend: Backend,
        cache_dir: Path | None,
        nursery: trio.Nursery,
        peer_models: PeerModels,
        links: Callable[[], tuple[PeerLink, ...]],
        meet: Callable[[tuple[PeerInfo, ...]], None],
        measure_when_asked: bool,
        claimed: Callable[[], bool],
    ) -> None:
        """``links``: this node's links now; ``meet``: connect to peers; ``claimed``:
        whether a run holds this node now."""
        self.node_id, self._send = node_id, send
        self._backend, self._cache_dir, self._nursery = backend, cache_dir, nursery
        self._peer_models, self._links, self._meet = peer_models, links, meet
        self._measure_when_asked, self._held = measure_when_asked, claimed
        self._asked: tuple[str, SpeedQuery] | None = None  # the latest query, and its host
        self._measured_asked: set[str] = set()  # model ids measured (or tried) when asked
        # what those measured, by model id: a node without a cache folder keeps no file
        self._known: dict[str, tuple[SelfMeasure, int]] = {}
        self._measuring: set[str] = set()
        self.measure_lock = trio.Lock()  # one measurement at a time, a Prepare's included
        self._claimed = trio.Event()  # set by the next claim this node accepts

    async def answer(self, peer: str, query: SpeedQuery) -> None:
        """``peer``'s query: meet the peers it names, answer it, keep it to answer again."""
        self._asked = (peer, query)
        self._meet(query.peers)
        await self._answer(peer, query)

    async def link_measured(self) -> None:
        """A link to a peer was measured (or this node itself): answer the latest query
        again, so that its host learns it now (best effort: without a session it asks
        again)."""
        if self._asked is not None:
            with contextlib.suppress(*SEND_ERRORS):
                await self._answer(*self._asked)

    def claimed_now(self) -> None:
        """This node accepted a claim: a measurement asked for and not begun is left to
        the claim's ``Prepare``."""
        self._claimed.set()
        self._claimed = trio.Event()

    def peer_lost(self, peer: str) -> None:
        """The session with ``peer`` ended: its query is answered no more."""
        if self._asked is not None and self._asked[0] == peer:
            self._asked = None

    async def _answer(self, peer: str, query: SpeedQuery) -> None:
        refused = bool(self._peer_models.refusal(query.package_ref))
        cache_dir = None if refused else self._cache_dir  # None: an empty report
        model_id = f"{query.package_ref}@{query.pin}"
        known = None if refused else self._known.get(model_id)
        answer = partial(speed_report, query, self.node_id, self._backend, cache_dir,
                         self._links(), model_id in self._measuring, known)  # fmt: skip
        report = await trio.to_thread.run_sync(answer)
        cold = report.decode_us == 0 and not refused and not self._held()
        if cold and self._measure_when_asked and self._may_measure(model_id):
            self._measured_asked.add(model_id)
            self._measuring.add(model_id)
            self._nursery.start_soon(self._measure, query, model_id, self._claimed)
            report = dataclasses.replace(report, measuring=True)
        await self._send(peer, report)

    def _may_measure(self, model_id: str) -> bool:
        asked = self._measured_asked
        return not self._measuring and model_id not in asked and len(asked) < MAX_ASKED_MODELS

    async def _measure(self, query: SpeedQuery, model_id: str, claimed: trio.Event) -> None:
        """Unless a plan claims this node within ``SPARE_AFTER_S`` of the query
        (``claimed``), measure it on the first layer of the model ``query`` names; then
        answer the latest query again."""
        cache_dir, ref = self._cache_dir, query.package_ref
        with trio.move_on_after(SPARE_AFTER_S) as spare:
            await claimed.wait()
        if not spare.cancelled_caught:  # claimed: not measuring after all
            self._measuring.discard(model_id)
            await self.link_measured()
            return
        try:
            source = await trio.to_thread.run_sync(
                lambda: open_ref(ref, Part(0, 1), cache_dir=cache_dir, pin=query.pin)
            )
            async with self.measure_lock:
                measured = await trio.to_thread.run_sync(
                    lambda: measure_or_reason(
                        source, 0, self._backend, model_id=model_id, cache_dir=cache_dir
                    )
                )
            if isinstance(measured, SelfMeasure):  # else its reason is logged: by memory
                self._known[model_id] = (measured, 0)
        except Exception as exc:  # planned by memory, as a node whose measurement failed
            log.warning("measuring %s when asked failed: %s: %s", ref, type(exc).__name__, exc)
        finally:
            self._measuring.discard(model_id)
        await self.link_measured()
