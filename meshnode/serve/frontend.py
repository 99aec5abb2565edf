"""The API side of a mesh host: the service of ``join --model`` and what it serves on.

:func:`host_service` builds the :class:`~meshnode.serve.service.ServeService` of the host
(no pipeline yet: 503 until the mesh is placed) and :func:`host_speculation` its
speculative settings and draft model. :class:`HostFrontend` is the host role's
:class:`~meshnode.node.host.Frontend`: the coordinator hands it every pipeline it brings
up. A layer-skip drafter is built from the stage-0 layers of each of them (each plan may
give stage 0 a different range) in the background, so requests decode plainly until it
is ready.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.loader import ModelSource, generation_defaults, open_stage_source
from meshnode.engine.model import Stage
from meshnode.engine.tokenizer import ChatTemplate, Tokenizer
from meshnode.node.config import NodeConfig
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.remote import RemotePipeline
from meshnode.node.stage import default_context
from meshnode.serve.scheduler import SchedulerLimits
from meshnode.serve.service import ServeService
from meshnode.serve.single import EngineCodec, model_id_for
from meshnode.serve.speculation import SpeculationHost, speculation_host


class HostFrontend:
    """Serves the host's pipelines through ``service`` (see the module docstring)."""

    def __init__(
        self, service: ServeService, model_ref: str, cache_dir: Path | None = None
    ) -> None:
        self.service = service
        self.model_ref = model_ref
        self.cache_dir = cache_dir
        self._pipelines = 0  # pipelines handed over so far: a stale drafter build is dropped
        self._stage0: Stage | None = None
        self._rebuild = trio.Event()

    def serve_on(self, pipeline: RemotePipeline | None) -> None:
        """Serve on ``pipeline`` (``None``: 503 until the next); rebuild a layer-skip draft."""
        self._pipelines += 1
        spec = self.service.spec_host
        if spec is not None:
            spec.forget_costs()
        if spec is not None and spec.settings.strategy == "layer-skip":
            # The old drafter shares the old stage 0's weights: drop it now; requests
            # decode plainly until the new one is built.
            spec.attach_stage0(None, self._no_source)
            self._stage0 = None if pipeline is None else pipeline.runner.stage
            self._rebuild.set()
        self.service.set_pipeline(pipeline)

    def in_flight(self) -> int:
        """Requests being generated now (a replay waiting for its pipeline included)."""
        return self.service.scheduler.in_flight

    def status(self) -> dict[str, Any]:
        """Model id, requests in flight and waiting, and speculation, for the ``host`` part."""
        body = {
            "model_id": self.service.model_id,
            "requests_in_flight": self.service.scheduler.in_flight,
            "requests_waiting": self.service.scheduler.waiting,
            "speculation": self.service.speculation_status(),
        }
        pipeline = self.service.pipeline
        if isinstance(pipeline, RemotePipeline):  # stage 0, run by the host itself
            body["kv"] = pipeline.runner.kv_usage()
        return body

    async def run(self) -> None:
        """Build the layer-skip drafter of each new pipeline's stage 0, until cancelled."""
        spec = self.service.spec_host
        while True:
            await self._rebuild.wait()
            self._rebuild = trio.Event()
            stage, wanted = self._stage0, self._pipelines
            if spec is None or stage is None:
                continue
            await trio.to_thread.run_sync(self._build_drafter, spec, stage, wanted)

    def _build_drafter(self, spec: SpeculationHost, stage: Stage, wanted: int) -> None:
        if wanted == self._pipelines:  # unless a newer pipeline came first
            spec.attach_stage0(stage, self._head_source(stage))

    def _head_source(self, stage: Stage) -> Callable[[], ModelSource]:
        """Opens the final norm (and untied head) for a stage 0 that does not hold them."""
        ref, end, cache_dir = self.model_ref, stage.end, self.cache_dir
        return lambda: open_stage_source(ref, 0, end, embed=True, head=True, cache_dir=cache_dir)

    @staticmethod
    def _no_source() -> ModelSource:
        raise AssertionError("dropping a drafter opens no source")


def host_speculation(config: NodeConfig, source: ModelSource, backend: Backend) -> SpeculationHost:
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
    return ServeService(
        model_id=model_id_for(config.model),
        aliases=[config.model],
        codec=EngineCodec(tokenizer, template, model.vocab_size),
        context_size=config.context_size or default_context(model),
        eos_token_ids=frozenset(model.eos_token_ids),
        limits=SchedulerLimits(max_in_flight=MAX_SEQUENCES_PER_STAGE),
        spec_host=spec,
        chunk_tokens=config.prefill_chunk_tokens,
        generation_defaults=generation_defaults(source),
    )
