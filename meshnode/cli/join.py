"""``meshnode join``'s composition root: the daemon, its HTTP API and, with ``--model``,
the host role and the OpenAI API it serves.

Every node runs the mesh daemon (:mod:`meshnode.node.daemon`) and serves
``GET /v1/mesh/status``. The node started with ``--model`` is the *host*
(:class:`~meshnode.node.host.MeshHost`): it holds stage 0, runs the coordinator that places
the model on the mesh, and hands each pipeline to the API
(:class:`~meshnode.serve.frontend.HostFrontend`), which answers 503 with ``Retry-After``
until every stage is ready (and again while the mesh replans after losing a stage).

Speculative decoding runs on the host (DESIGN §7): its settings are resolved and a draft
model is loaded before the node starts (:mod:`meshnode.serve.speculation`).
"""

from __future__ import annotations

import logging
import os

import trio
from fastapi import FastAPI
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref, pin_ref, pinned_ref
from meshnode_packaging.sources import ModelSource

from meshnode.engine.backend import Backend, BackendError, select_backend
from meshnode.engine.kv_cache import resolve_kv_dtype
from meshnode.engine.loader import reading_model
from meshnode.engine.recurrent import ring_slots_for
from meshnode.errors import ConfigError, ModelError
from meshnode.net.http_guard import ApiAccess, BodyLimits, check_api_exposure
from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node import process
from meshnode.node.config import NodeConfig
from meshnode.node.daemon import Node
from meshnode.node.host import MeshHost
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.remote import PassDeadline
from meshnode.serve.app import create_app
from meshnode.serve.availability import unavailable_message
from meshnode.serve.frontend import HostFrontend, host_service, host_speculation
from meshnode.serve.openai_api import mount_openai
from meshnode.serve.service import ServeService

log = logging.getLogger("meshnode.join")


def open_stage0(config: NodeConfig) -> tuple[ModelSource, str]:
    """The model's config, tokenizer and template (the manifest and embedding part), and the
    pin every stage will read (``refs.pin_ref``: resolved once, here).

    Raises ConfigError with a one-line reason for a bad ``--model``.
    """
    assert config.model is not None
    try:
        with reading_model():
            pin = pin_ref(config.model, cache_dir=config.cache_dir)
            source = open_ref(
                config.model, Part(0, 0, embed=True), cache_dir=config.cache_dir, pin=pin
            )
    except ModelError as exc:
        raise ConfigError(f"--model {config.model}: {exc}") from exc
    if pin:
        log.info("--model %s pinned at %s", config.model, pin)
    return source, pin


def run_cpu_dtype(backend: Backend) -> str:
    """The arithmetic the host's run asks of every CPU stage that keeps GGUF blocks
    (``Load.cpu_dtype``): q8 where the host computes in q8, native (exact) where it computes
    exactly (the CPU's native and float32, CUDA's float32), else each stage its own."""
    if backend.weights_dtype == "q8":
        return "q8"
    if backend.name == "cpu" or backend.weights_dtype == "float32":
        return "native"
    return ""


async def build_node(config: NodeConfig, token: JoinToken, identity: NodeIdentity) -> Node:
    """The node ``meshnode join`` runs: a plain mesh node, or the host with ``--model``."""
    host: MeshHost | None = None
    service: ServeService | None = None
    if config.model is not None:
        source, pin = await trio.to_thread.run_sync(open_stage0, config)
        backend = select_backend(config.device, config.weights_dtype)
        spec = await trio.to_thread.run_sync(host_speculation, config, source, backend)
        service = host_service(config, source, spec)
        settings = CoordinatorSettings(
            model_ref=config.model,
            context_size=service.context_size,
            split=config.split,
            wire_dtype=config.wire_dtype,
            kv_dtype=resolve_kv_dtype(config.kv_dtype, backend.weights_dtype),
            cpu_dtype=run_cpu_dtype(backend),
            cache_dir=config.cache_dir,
            pin=pin,
            ring_slots=ring_slots_for(spec.largest_verify_drafts()),
            pass_deadline=PassDeadline(config.pass_deadline_s, config.pass_deadline_per_token_s),
            suspect_grace_s=config.heartbeat.suspect_grace_s,
            calibrate=config.placement == "speed",
            place_by_speed=config.placement == "speed",
            disk_offload=config.disk_offload,
        )
        # The layer-skip drafter opens the host's layers again: at the same commit.
        frontend = HostFrontend(service, pinned_ref(config.model, pin), config.cache_dir)
        host = MeshHost(settings, source, frontend, backend)

    if service is not None and host is not None:
        service.unavailable_reason = lambda: unavailable_message(host.status())
    access = ApiAccess.for_bind(config.api, config.api_key)
    limits = BodyLimits(max_bytes=config.api_max_body_bytes)

    def app_factory(node: Node) -> FastAPI:
        app = create_app(
            node.status, access=access, limits=limits, cors_origins=config.cors_origins
        )
        if service is not None:
            mount_openai(app, service)
        return app

    return Node(config, token, identity, app_factory=app_factory, host=host)


def run(config: NodeConfig) -> int:
    """Run ``meshnode join`` with ``config`` until interrupted; the exit status.

    Raises ``ConfigError`` before anything starts when the device or weights dtype cannot
    be had here (``--device cuda`` without one, ``--dtype float16`` on a CPU), and when the
    API would be reachable from other machines without a key.
    """
    process.configure_logging(config)
    check_api_exposure(config.api, config.api_key, config.allow_open_api)
    try:
        backend = select_backend(config.device, config.weights_dtype)
    except BackendError as exc:
        raise ConfigError(str(exc)) from exc
    threads = config.threads or f"{os.cpu_count()} (one per core)"
    log.info("compute backend: %s; CPU threads: %s", backend.describe(), threads)
    return process.run(config, build_node)
