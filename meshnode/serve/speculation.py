"""Speculative decoding on the serving node: from resolved settings to the live strategy.

The node that serves a model (the host of a mesh, or a single node) resolves its
speculative settings once at start (:func:`resolve_for_model`: CLI > ``[models…]`` >
``[defaults…]`` > the package's block > built-in), then :class:`SpeculationHost` turns them
into the :class:`~meshnode.generation.records.Speculation` each request gets:

- ``auto`` / ``ngram``: a fresh n-gram proposer per request, nothing to load;
- ``draft``: a whole draft model loaded on this node only (:func:`load_draft`), checked
  against the target's vocabulary and the memory available;
- ``layer-skip``: the target's first layers that stage 0 holds, plus the final norm and
  head, sharing stage 0's weight arrays. Stage 0's range changes when the coordinator
  replans, so the drafter is rebuilt by :meth:`SpeculationHost.attach_stage0` every time
  a pipeline is handed to the API.

A draft that cannot be built (missing, vocabulary mismatch, no memory, stage 0 without the
layers) never stops serving: the node falls back to the next strategy the settings allow,
logs one warning, and :meth:`SpeculationHost.status` (shown by ``meshnode status``) says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.loader import ModelSource, reading_model, resolve_source
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.errors import ModelError
from meshnode.generation.records import Speculation
from meshnode.node.footprint import model_footprint
from meshnode.speculative.draft import (
    DraftIncompatibleError,
    draft_model_stage,
    layer_skip_layers,
    layer_skip_stage,
    vocab_info,
)
from meshnode.speculative.factory import build_proposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.settings import (
    SpeculativeFlags,
    SpeculativeSettings,
    Strategy,
    package_block,
    resolve_speculative,
)
from meshnode.speculative.telemetry import SpecStats
from meshnode.speculative.window import StepCosts

log = logging.getLogger("meshnode.speculation")

# The strategy a node falls back to when a layer-skip drafter cannot be built: auto costs
# nothing until the request shows that n-gram lookups pay (meshnode.speculative.auto).
LAYER_SKIP_FALLBACK: Strategy = "auto"
# Memory a draft model may take, as a share of what the OS reports available: the rest is
# headroom for KV caches and the stage itself growing under load.
DRAFT_MEMORY_SHARE = 0.8


class DraftUnavailableError(ModelError):
    """The draft model cannot be used here; the message is the reason ``status`` shows."""


def config_model_key(tables: Mapping[str, Any], model_id: str, model_ref: str | None) -> str:
    """The ``[models."<id>"]`` key that names this model: the served id, else its reference."""
    models = tables.get("models", {})
    if model_id not in models and model_ref is not None and model_ref in models:
        return model_ref
    return model_id


def resolve_for_model(
    flags: SpeculativeFlags,
    tables: Mapping[str, Any],
    *,
    model_id: str,
    model_ref: str | None,
    source: ModelSource,
    draft_unavailable: str | None = None,
) -> SpeculativeSettings:
    """Resolve the settings of the served model.

    Raises ``SpeculativeConfigError`` (a ``ConfigError``) for a bad value.
    """
    return resolve_speculative(
        flags,
        tables,
        config_model_key(tables, model_id, model_ref),
        package_block(source),
        draft_unavailable=draft_unavailable,
    )


def load_draft(
    ref: str,
    target: ModelSource,
    target_name: str,
    backend: Backend,
    *,
    cache_dir: Path | None = None,
    available_bytes: int | None = None,
) -> Stage:
    """Open and load draft model ``ref`` (whole, on this node) for ``target``.

    ``available_bytes`` defaults to the memory the OS reports available. Raises
    :class:`DraftUnavailableError` naming why: the reference resolves to nothing, the
    vocabulary differs, or the weights would not fit.
    """
    try:
        with reading_model():
            source = resolve_source(ref, cache_dir=cache_dir)
            config = ModelConfig.from_hf(source.config)
    except ModelError as exc:
        raise DraftUnavailableError(f"cannot open it: {_one_line(exc)}") from exc
    need = _weight_bytes(config)
    have = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if need > have * DRAFT_MEMORY_SHARE:
        raise DraftUnavailableError(
            f"not enough memory: it needs {need / 2**20:.0f} MiB, {have / 2**20:.0f} MiB available"
        )
    try:
        with reading_model():
            return draft_model_stage(vocab_info(target_name, target), ref, source, backend)
    except DraftIncompatibleError as exc:
        raise DraftUnavailableError(str(exc)) from exc
    except ModelError as exc:
        raise DraftUnavailableError(f"cannot load it: {_one_line(exc)}") from exc


def _weight_bytes(config: ModelConfig) -> int:
    footprint = model_footprint(config)
    return sum(footprint.layer_bytes) + footprint.embed_bytes + footprint.head_bytes


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class SpeculationHost:
    """The node's live speculation: strategy, draft stage, fallbacks and their reasons.

    ``resolve_again(reason)`` resolves the settings once more with the draft marked
    unavailable (``resolve_for_model(…, draft_unavailable=reason)``).
    """

    def __init__(
        self,
        settings: SpeculativeSettings,
        *,
        resolve_again: Callable[[str], SpeculativeSettings] | None = None,
    ) -> None:
        self.requested = settings
        self.settings = settings
        self._resolve_again = resolve_again
        self.draft_stage: Stage | None = None
        self.layer_skip: dict[str, Any] | None = None
        # What a step costs by window size, shared by all requests; measured afresh for
        # every pipeline (other stages, other machines, other costs).
        self.costs = StepCosts()
        self.warnings: list[str] = list(settings.warnings)
        for warning in settings.warnings:
            log.warning("speculative decoding: %s", warning)

    # -- building -------------------------------------------------------------------------

    def load_draft_model(self, load: Callable[[str], Stage]) -> None:
        """Load the draft model if the strategy is ``draft``; fall back if it cannot be."""
        ref = self.settings.draft_model
        if self.settings.strategy != "draft" or ref is None:
            return
        try:
            self.draft_stage = load(ref)
        except DraftUnavailableError as exc:
            self._fall_back(f"draft model {ref} unavailable: {exc}", draft_reason=str(exc))

    def attach_stage0(self, stage: Stage | None, head_source: Callable[[], ModelSource]) -> None:
        """Rebuild the layer-skip drafter over ``stage`` (stage 0 of the current pipeline).

        ``head_source`` opens a source holding the final norm (and an untied head) for a
        stage 0 that does not hold them; it is called only then. ``None`` drops the
        drafter (the mesh is replanning).
        """
        if self.settings.strategy != "layer-skip":
            return
        self.draft_stage, self.layer_skip = None, None
        if stage is None:
            return
        try:
            with reading_model():
                count = self._layer_skip_count(stage)
                source = None if stage.head else head_source()
                self.draft_stage = layer_skip_stage(stage, count, source)
        except ModelError as exc:
            self._fall_back(f"layer-skip unavailable: {_one_line(exc)}")
            return
        self.layer_skip = {"layers": count, "of": stage.config.num_layers, "stage0": stage.end}
        log.info(
            "layer-skip drafts with the first %d of %d layers (stage 0 holds %d)",
            count,
            stage.config.num_layers,
            stage.end,
        )

    def forget_costs(self) -> None:
        """Drop the measured step costs: a new pipeline has its own."""
        self.costs = StepCosts()

    def _layer_skip_count(self, stage: Stage) -> int:
        wanted = layer_skip_layers(stage.config, self.settings.layer_skip_layers)
        if stage.head or wanted <= stage.end:
            return wanted
        # Stage 0 of a split holds fewer layers than asked for: draft with all it holds
        # (no other layers are on this node, and fetching them would defeat the point).
        note = f"layer-skip uses the {stage.end} layers stage 0 holds, not {wanted}"
        if note not in self.warnings:
            self.warnings.append(note)
            log.warning("speculative decoding: %s", note)
        return stage.end

    def _fall_back(self, why: str, *, draft_reason: str | None = None) -> None:
        if draft_reason is not None and self._resolve_again is not None:
            fallback = self._resolve_again(draft_reason)
        else:
            fallback = replace(self.settings, strategy=LAYER_SKIP_FALLBACK, draft_model=None)
        message = f"{why}; serving with {fallback.strategy}"
        log.warning("speculative decoding: %s", message)
        self.warnings.append(message)
        self.settings = fallback
        self.draft_stage = None

    # -- per request ----------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        """The strategy requests get now (``off`` while a layer-skip drafter is missing)."""
        if self.settings.strategy in ("draft", "layer-skip") and self.draft_stage is None:
            return "off"
        return self.settings.strategy

    def largest_verify_drafts(self) -> int:
        """Drafts in the largest verify pass a request may send (0: no speculation); what
        hybrid stages size their snapshot rings by (``engine.recurrent.ring_slots_for``)."""
        return 0 if self.settings.strategy == "off" else self.settings.window.max_window

    def speculation(self) -> Speculation | None:
        """The :class:`~meshnode.generation.records.Speculation` for new requests, or ``None``."""
        strategy = self.strategy
        if strategy == "off":
            return None
        settings, stage = self.settings, self.draft_stage

        def make(params: SamplingParams, capacity: int) -> Proposer | None:
            return build_proposer(settings, params, capacity=capacity, draft_stage=stage)

        return Speculation(
            make, settings.window, strategy=strategy, threaded=stage is not None, costs=self.costs
        )

    # -- status ---------------------------------------------------------------------------

    def status(self, stats: SpecStats) -> dict[str, Any]:
        """JSON-ready: live strategy, how it was chosen, acceptance so far, warnings."""
        resolved = self.settings.as_dict()
        return {
            "strategy": self.strategy,
            "requested": self.requested.strategy,
            "draft_model": self.settings.draft_model,
            "layer_skip": self.layer_skip,
            "window": resolved["window"],
            "sources": resolved["sources"],
            "acceptance": {
                "windows": stats.windows,
                "proposed": stats.proposed,
                "accepted": stats.accepted,
                "accept_rate": stats.accept_rate,
                "tokens_per_verify": stats.tokens_per_verify,
                "cost_per_accepted_token_s": stats.cost_per_accepted_token,
            },
            # Measured seconds of a step by its number of drafts (adaptive windows).
            "step_costs_s": {str(k): v for k, v in sorted(self.costs.seconds.items())},
            "warnings": list(self.warnings),
        }


def speculation_host(
    flags: SpeculativeFlags,
    tables: Mapping[str, Any],
    *,
    model_id: str,
    model_ref: str | None,
    source: ModelSource,
    backend: Backend,
    cache_dir: Path | None = None,
    available_bytes: int | None = None,
) -> SpeculationHost:
    """Resolve the served model's settings and load its draft model if they name one.

    Blocking (a draft model loads here): call it off the event loop. Raises
    ``ConfigError`` for an invalid setting; an unusable draft only falls back.
    """

    def resolve(draft_unavailable: str | None = None) -> SpeculativeSettings:
        return resolve_for_model(
            flags,
            tables,
            model_id=model_id,
            model_ref=model_ref,
            source=source,
            draft_unavailable=draft_unavailable,
        )

    def load(ref: str) -> Stage:
        return load_draft(
            ref, source, model_id, backend, cache_dir=cache_dir, available_bytes=available_bytes
        )

    host = SpeculationHost(resolve(), resolve_again=resolve)
    host.load_draft_model(load)
    log.info("speculative decoding: %s", host.settings.strategy)
    return host
