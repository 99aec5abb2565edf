"""Building a run's stage on a worker from the coordinator's ``Load``: the backend its
arithmetic needs (the host's) and the stage runner, bounded by what this node offers.

Blocking (it opens and maps the weights): the worker calls it off the event loop.
"""

from __future__ import annotations

import logging
from typing import cast

from meshnode_packaging.sources import ModelSource
from meshnode_protocol import Load

from meshnode.engine.backend import Backend, BackendError, WeightsDtype, cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.constraint import Grammars
from meshnode.engine.model import Stage
from meshnode.engine.readahead import populate_weights, read_ahead
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS, MAX_RING_SLOTS
from meshnode.errors import RunError
from meshnode.node import heap
from meshnode.node.footprint import check_load
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.prefix import StagePrefix
from meshnode.node.prefix_keep import stage_identity, take_over
from meshnode.node.stage import StageRunner

log = logging.getLogger("meshnode.worker")


def run_backend(backend: Backend, cpu_dtype: str) -> Backend:
    """The backend a stage of a run computes on: a CPU one that keeps GGUF blocks takes
    the arithmetic the run's host computes in (``cpu_dtype``: ``native`` or ``q8``; empty:
    ``backend`` as it is), so that every stage of a mesh rounds the same way whatever its
    own ``--dtype``; a CUDA one, or the CPU's float32 (the parity-debugging mode), is kept.
    Raises :class:`BackendError` for another ``cpu_dtype`` (a newer host's)."""
    if cpu_dtype not in ("", "native", "q8"):
        raise BackendError(f"the run computes in {cpu_dtype!r}; this node knows native and q8")
    if not cpu_dtype or backend.name != "cpu" or not backend.cpu_blocks:
        return backend
    if cpu_dtype != backend.weights_dtype:
        log.info("this run computes in --dtype %s, the host's (ours: %s)", cpu_dtype,
                 backend.weights_dtype)  # fmt: skip
    return cpu_backend(cast(WeightsDtype, cpu_dtype))


def build_runner(
    backend: Backend,
    source: ModelSource,
    start: int,
    end: int,
    load: Load,
    memory_bytes: int | None = None,
    *,
    owner: tuple[str, str, str] = ("", "", ""),
    kept: StagePrefix | None = None,
) -> StageRunner:
    """The stage runner ``load`` asks for, over ``source`` (blocking: call off the loop).

    A CPU ``backend`` that keeps GGUF blocks computes in the Load's ``cpu_dtype``, the
    host's (:func:`run_backend`). Raises ``RunError`` for a snapshot ring larger than a
    stage keeps, a KV dtype or CPU dtype it does not keep, and for a context the model
    cannot hold or whose KV alone exceeds
    ``memory_bytes`` (a peer may ask for
    anything; each slot and each token of context costs memory per layer and sequence).

    ``owner`` is (the coordinator that claimed this node, the package ref and pin this
    node prepared: what ``source`` is);
    ``kept`` an earlier run's pool, which the stage takes over when it is the same stage
    of the same pipeline (:func:`~meshnode.node.prefix_keep.stage_identity`).
    """
    if load.ring_slots > MAX_RING_SLOTS:
        raise RunError(
            f"Load asks for {load.ring_slots} snapshot-ring slots; a stage keeps at most "
            f"{MAX_RING_SLOTS}"
        )
    try:
        backend = run_backend(backend, load.cpu_dtype)
    except BackendError as exc:
        raise RunError(f"Load: {exc}") from exc
    salt = load.prefix_seed or load.run_id  # hook (issue 30): keyed by the pipeline
    identity = stage_identity(
        load.prefix_seed,
        coordinator=owner[0],
        model=owner[1:],
        layers=(start, end, load.has_embed, load.has_head),
        kv_dtype=load.kv_dtype,
        backend=backend,
        context_size=load.context_size,
    )
    prefix = take_over(kept, identity, salt, load.context_size)
    kept = None  # not taken over: freed before the weights are mapped (a GPU's memory)
    config = ModelConfig.from_hf(source.config)
    kv = check_load(config, start, end, load.context_size, memory_bytes, load.kv_dtype)
    stage = Stage(
        config,
        source,
        start,
        end,
        embed=load.has_embed,
        head=load.has_head,
        backend=backend,
        ring_slots=load.ring_slots or DEFAULT_RING_SLOTS,
        kv_dtype=load.kv_dtype,
    )
    # the mesh is short of memory: some of the layers come from disk (planner)
    short = memory_bytes is not None and stage.weights.nbytes() + kv > memory_bytes
    place_weights(stage, short=short)
    # Only a last stage enforces grammars; it reads the tokenizer at its first one.
    grammars = Grammars(lambda: source.tokenizer_json, config.vocab_size, config.eos_token_ids)
    runner = StageRunner(
        stage,
        context_size=load.context_size,
        max_sequences=MAX_SEQUENCES_PER_STAGE,
        grammars=grammars if load.has_head else None,
        prefix_salt=salt,
        prefix_identity=identity,
        prefix=prefix,
    )
    heap.release_free_memory()  # what opening the model and loading the stage freed
    return runner


def place_weights(stage: Stage, *, short: bool) -> None:
    """Bring ``stage``'s file-mapped weights into memory as its node can hold them: read
    ahead a layer at a time when it is ``short`` of memory for them (the planner's disk
    offload: populating would evict the pages that run), else every page faulted in now,
    in the load's time rather than the first requests' (:mod:`meshnode.engine.readahead`),
    and logged."""
    if short:
        read_ahead(stage)
        return
    done = populate_weights(stage)
    if done.advice:
        how = "faulted in" if done.advice == "populate" else "read ahead (no MADV_POPULATE_READ)"
        log.info("layers [%d, %d): %.0f MiB of weights %s at load in %.2f s",
                 stage.start, stage.end, done.nbytes / 2**20, how, done.seconds)  # fmt: skip
