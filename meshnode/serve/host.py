"""``meshnode join``: the daemon, its HTTP API and, with ``--model``, the host role.

Every node runs the mesh daemon (:mod:`meshnode.node.daemon`) and serves
``GET /v1/mesh/status``. The node started with ``--model`` is the *host*: it holds stage 0,
runs the coordinator that places the model on the mesh, and serves the OpenAI API, which
answers 503 with ``Retry-After`` until every stage is ready (and again while the mesh
replans after losing a stage).

Speculative decoding runs on the host (DESIGN §7): its settings are resolved and a draft
model is loaded before the node starts (:mod:`meshnode.serve.speculation`); a layer-skip
drafter is built from the stage-0 layers of every pipeline the coordinator hands over,
because each plan may give stage 0 a different range.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from fastapi import FastAPI
from meshnode_packaging.errors import PackageError
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref
from meshnode_packaging.sources import ModelSource, SourceError
from meshnode_protocol import Message

from meshnode.engine.backend import Backend, BackendError, select_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.tokenizer import ChatTemplate, Tokenizer
from meshnode.errors import ConfigError
from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node import daemon
from meshnode.node.config import NodeConfig
from meshnode.node.coordinator import Coordinator, CoordinatorSettings
from meshnode.node.daemon import Node
from meshnode.node.remote import RemotePipeline
from meshnode.node.worker import MAX_SEQUENCES_PER_STAGE
from meshnode.serve.app import create_app
from meshnode.serve.openai_api import mount_openai
from meshnode.serve.scheduler import SchedulerLimits
from meshnode.serve.service import ServeService
from meshnode.serve.single import EngineCodec, model_id_for
from meshnode.serve.speculation import SpeculationHost, speculation_host

log = logging.getLogger("meshnode.host")


class MeshHost:
    """The host role of :class:`~meshnode.node.daemon.Node`: coordinator plus API service."""

    def __init__(
        self,
        config: NodeConfig,
        source: ModelSource,
        service: ServeService,
        backend: Backend,
    ) -> None:
        assert config.model is not None  # only built for --model
        self.settings = CoordinatorSettings(
            model_ref=config.model,
            context_size=service.context_size,
            split=config.split,
            wire_dtype=config.wire_dtype,
            cache_dir=config.cache_dir,
        )
        self.source = source
        self.service = service
        self.backend = backend
        self.coordinator: Coordinator | None = None
        self._nursery: trio.Nursery | None = None
        self._pipelines = 0  # pipelines handed over so far: a stale drafter build is dropped
        self._draft_lock = trio.Lock()

    def handle(self, peer: str, message: Message) -> bool:
        return self.coordinator is not None and self.coordinator.handle(peer, message)

    def peer_lost(self, peer: str) -> None:
        if self.coordinator is not None:
            self.coordinator.peer_lost(peer)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.settings.model_ref, "state": "starting"}
        if self.coordinator is not None:
            body = self.coordinator.status()
        body["model_id"] = self.service.model_id
        body["requests_in_flight"] = self.service.scheduler.in_flight
        body["speculation"] = self.service.speculation_status()
        return body

    async def run(self, node: Node) -> None:
        self.coordinator = Coordinator(
            node,
            self.settings,
            source=self.source,
            backend=self.backend,
            on_pipeline=self._serve_on,
        )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.coordinator.run()

    def _serve_on(self, pipeline: RemotePipeline | None) -> None:
        if pipeline is None:
            log.warning("the mesh lost a stage: API answers 503 until it is placed again")
        else:
            log.info("serving %s on %d stage(s)", self.service.model_id, len(pipeline.stage_nodes))
        self._pipelines += 1
        spec = self.service.spec_host
        if spec is not None:
            spec.forget_costs()
        if spec is not None and spec.settings.strategy == "layer-skip":
            # The old drafter shares the old stage 0's weights: drop it now; requests
            # decode plainly until the new one is built.
            spec.attach_stage0(None, lambda: self.source)
            if pipeline is not None and self._nursery is not None:
                self._nursery.start_soon(self._build_drafter, spec, pipeline.runner.stage)
        self.service.set_pipeline(pipeline)

    async def _build_drafter(self, spec: SpeculationHost, stage: Stage) -> None:
        """Build the layer-skip drafter over ``stage`` unless a newer pipeline came first."""
        wanted = self._pipelines
        async with self._draft_lock:
            if wanted != self._pipelines:
                return
            await trio.to_thread.run_sync(spec.attach_stage0, stage, self._head_source(stage))

    def _head_source(self, stage: Stage) -> Callable[[], ModelSource]:
        """Opens the final norm (and untied head) for a stage 0 that does not hold them."""
        part = Part(0, stage.end, embed=True, head=True)
        return lambda: open_ref(self.settings.model_ref, part, cache_dir=self.settings.cache_dir)


def open_stage0(config: NodeConfig) -> ModelSource:
    """The model's config, tokenizer and template (the manifest and embedding part).

    Raises ConfigError with a one-line reason for a bad ``--model``.
    """
    assert config.model is not None
    try:
        return open_ref(config.model, Part(0, 0, embed=True), cache_dir=config.cache_dir)
    except (PackageError, SourceError, OSError, ValueError) as exc:
        raise ConfigError(f"--model {config.model}: {exc}") from exc


def host_speculation(
    config: NodeConfig, source: ModelSource, backend: Backend
) -> SpeculationHost:
    """The host's speculative settings resolved, its draft model loaded (blocking).

    Raises ConfigError for an invalid setting; an unusable draft falls back with a warning.
    """
    assert config.model is not None
    return speculation_host(
        config.speculative,
        config.speculative_tables,
        model_id=model_id_for(config.model),
        model_ref=config.model,
        source=source,
        backend=backend,
        cache_dir=config.cache_dir,
    )


def host_service(
    config: NodeConfig, source: ModelSource, spec: SpeculationHost | None = None
) -> ServeService:
    """The API service of the host, with no pipeline yet (503 until the mesh is ready)."""
    assert config.model is not None
    model = ModelConfig.from_hf(source.config)
    tokenizer = Tokenizer(source.tokenizer_json)
    template = None
    if source.chat_template:
        specials = {}
        if model.bos_token_id is not None:
            specials["bos_token"] = tokenizer.decode([model.bos_token_id])
        if model.eos_token_ids:
            specials["eos_token"] = tokenizer.decode([model.eos_token_ids[0]])
        template = ChatTemplate(source.chat_template, specials)
    context = config.context_size or min(model.max_position_embeddings, 2048)
    return ServeService(
        model_id=model_id_for(config.model),
        aliases=[config.model],
        codec=EngineCodec(tokenizer, template, model.vocab_size),
        context_size=context,
        eos_token_ids=frozenset(model.eos_token_ids),
        limits=SchedulerLimits(max_in_flight=MAX_SEQUENCES_PER_STAGE),
        spec_host=spec,
        chunk_tokens=config.prefill_chunk_tokens,
    )


async def build_node(config: NodeConfig, token: JoinToken, identity: NodeIdentity) -> Node:
    """The node ``meshnode join`` runs: a plain mesh node, or the host with ``--model``."""
    host: MeshHost | None = None
    service: ServeService | None = None
    if config.model is not None:
        source = await trio.to_thread.run_sync(open_stage0, config)
        backend = select_backend(config.device, config.weights_dtype)
        spec = await trio.to_thread.run_sync(host_speculation, config, source, backend)
        service = host_service(config, source, spec)
        host = MeshHost(config, source, service, backend)

    def app_factory(node: Node) -> FastAPI:
        app = create_app(node.status)
        if service is not None:
            mount_openai(app, service)
        return app

    return Node(config, token, identity, app_factory=app_factory, host=host)


def run(config: NodeConfig) -> int:
    """Run ``meshnode join`` with ``config`` until interrupted; the exit status.

    Raises ``ConfigError`` before anything starts when the device or weights dtype cannot
    be had here (``--device cuda`` without one, ``--dtype float16`` on a CPU).
    """
    try:
        select_backend(config.device, config.weights_dtype)
    except BackendError as exc:
        raise ConfigError(str(exc)) from exc
    return daemon.run(config, build_node)
