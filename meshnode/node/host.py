"""The host role: the node started with ``--model`` places the model and serves it.

The host runs the :class:`~meshnode.node.coordinator.Coordinator` (plan, bring up, watch,
replan) and hands every pipeline it brings up to a :class:`Frontend`, the serving layer
above (``meshnode.serve``'s OpenAI API), which answers 503 until it holds one. The daemon
only sees :class:`MeshHost`: it routes the coordinator's control replies here and the data
replies (``Prediction``/``Error`` with a request id) straight to :attr:`MeshHost.pipeline`.

The frontend is handed in (``meshnode.cli.join`` composes both), so this package never
imports the serving layer.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import Message

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.node.coordinator import Coordinator
from meshnode.node.footprint import moe_status
from meshnode.node.mesh import CoordinatorSettings, MeshView
from meshnode.node.remote import RemotePipeline

log = logging.getLogger("meshnode.host")


class Frontend(Protocol):
    """What serves the pipelines the host brings up (the API service, for ``join``)."""

    def serve_on(self, pipeline: RemotePipeline | None) -> None:
        """Serve on ``pipeline`` from now on; ``None`` while the mesh (re)places the model."""
        ...

    def status(self) -> dict[str, Any]:
        """The serving fields of the ``host`` part of the status body."""
        ...

    def in_flight(self) -> int:
        """Requests being served now, including those waiting to replay on the next
        pipeline (which hold no sequence on any)."""
        ...

    async def run(self) -> None:
        """Background work of the frontend (building drafters), until cancelled."""
        ...


class MeshHost:
    """The host role of a node: coordinator plus the frontend it serves through."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        source: ModelSource,
        frontend: Frontend,
        backend: Backend,
    ) -> None:
        self.settings = settings
        self.source = source
        self.frontend = frontend
        self.backend = backend
        # experts per layer and active parameters of a mixture of experts, for the status
        self.moe = moe_status(ModelConfig.from_hf(source.config))
        self.coordinator: Coordinator | None = None
        self._scope = trio.CancelScope()  # the coordinator and the frontend's tasks

    @property
    def pipeline(self) -> RemotePipeline | None:
        """The pipeline requests run on now (``None`` while the mesh is not placed)."""
        return None if self.coordinator is None else self.coordinator.pipeline

    def handle(self, peer: str, message: Message) -> bool:
        """Take a control reply of the host's runs; False if it is not one."""
        return self.coordinator is not None and self.coordinator.handle(peer, message)

    def links_changed(self) -> None:
        """This node measured a link to a peer: the coordinator weighs the links again."""
        if self.coordinator is not None:
            self.coordinator.queries.links_changed()

    def peer_lost(self, peer: str, *, left: bool = False) -> None:
        """The session with ``peer`` ended (``left``: it said goodbye)."""
        if self.coordinator is not None:
            self.coordinator.peer_lost(peer, left=left)

    def status(self) -> dict[str, Any]:
        """The ``host`` part of the status body: the run and its stages, then serving
        (and a mixture of experts' ``moe`` shape: :func:`~meshnode.node.footprint.moe_status`)."""
        body: dict[str, Any] = {"model": self.settings.model_ref, "state": "starting"}
        if self.coordinator is not None:
            body = self.coordinator.status()
        body.update(self.frontend.status())
        if self.moe is not None:
            body["moe"] = self.moe
        return body

    async def run(self, mesh: MeshView) -> None:
        """Place the model on ``mesh`` and keep it placed, until cancelled."""
        self.coordinator = Coordinator(
            mesh,
            self.settings,
            source=self.source,
            backend=self.backend,
            on_pipeline=self._serve_on,
            in_flight=self.frontend.in_flight,
        )
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.frontend.run)
                await self.coordinator.run()

    def stop(self) -> None:
        """The node is stopping: plan, bring up and replan no more (a stage that leaves now
        is not replaced, nor announced as lost)."""
        self._scope.cancel()

    def _serve_on(self, pipeline: RemotePipeline | None) -> None:
        if pipeline is None:
            log.warning("the mesh is re-placing the model: API answers 503 until it is ready")
        else:
            stages = len(pipeline.stage_nodes)
            log.info("serving %s on %d stage(s)", self.settings.model_ref, stages)
        self.frontend.serve_on(pipeline)
