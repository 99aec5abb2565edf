"""Cached prefixes that outlive a run (issue 30): a replay reuses what the stages still hold.

When a stage is lost, or a pass is, the host brings up a new run and replays the requests
in flight on it (:mod:`meshnode.generation.replay`). Every run used to seed the hash
chain of its stages' cached blocks with its run id, so a new run found nothing to reuse.

**The seed.** The chain is seeded instead by the run's *prefix seed* (``Load.prefix_seed``,
:func:`pipeline_seed`): a digest of everything that changes any stage's K/V, as the host
plans it: the model and its pin, every stage's layer range, node and device, the KV, CPU
and wire dtypes, the host's own arithmetic, and the host (a host's blocks are never another
host's, whose requests could then probe for its prompts). Whatever else changes, a block's
K/V does not: the same seed means the same bits for the same tokens. The seed changes
with the plan, so a stage whose layer range (or anything upstream of it) changed never
finds a block of the old plan, whose key differs.

**Keeping a pool.** A stage's pool also has an *identity* (:func:`stage_identity`): the
seed plus what the stage itself knows it loaded (the model and pin it prepared, its layer
range and head/embedding, KV dtype, its backend and arithmetic, context, the coordinator
that claimed it). A new ``Load`` whose identity equals the pool's keeps the pool (the
sequences of the old run released first, their committed blocks staying cached); any
other starts an empty one, so a peer cannot make a stage serve blocks of another model:
the identity holds the model the stage prepared itself, whatever seed the peer sends. A
worker keeps a stopped run's pool for ``KEEP_POOL_S``, and only once no forward of the
old run can still touch it; the host keeps its own stage's pool from one run to the next
unless a stage-0 forward hangs.

**What the host believes.** Each re-loaded stage reports the keys it kept
(``Ready.prefix_keys``, :func:`held_keys`); the host believes, for the new run, the blocks
every stage holds, its own included (:func:`common_keys`), and resumes a replayed (or new)
request from them. A belief that turns out wrong costs one ``PREFIX_MISS`` and a prefill
from 0, as before.

Residual: the seed names a remote node's device kind, not its CUDA weight dtype; a CUDA
node restarted under the same id with another ``--dtype`` holds nothing itself, but a
stage after it may keep blocks computed from its old arithmetic.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from meshnode_protocol import MAX_READY_PREFIX_KEYS

from meshnode.engine.backend import Backend
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.planner import Plan, StagePlan
from meshnode.node.prefix import StagePrefix, pool_blocks

if TYPE_CHECKING:
    from meshnode.node.mesh import CoordinatorSettings, MeshView

__all__ = [
    "KEEP_POOL_S",
    "KeptPool",
    "SeedStage",
    "backend_tag",
    "common_keys",
    "held_keys",
    "host_identity",
    "host_seed",
    "pipeline_seed",
    "stage_identity",
    "take_over",
]

#: How long a worker keeps a stopped run's pool for the next ``Load`` of the same stage:
#: a replay waits at most this long for its next pipeline (``REPLAY_WAIT_S``), and a pool
#: nobody reloads holds a stage's KV memory for nothing.
KEEP_POOL_S = 120.0
#: Bumped when what a seed or identity digests changes meaning.
_VERSION = "meshnode-prefix-1"


def _digest(*parts: object) -> str:
    """16 bytes of BLAKE2b over ``parts`` (JSON: unambiguous), as 32 lowercase hex digits."""
    text = json.dumps([_VERSION, *parts], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def backend_tag(backend: Backend) -> str:
    """A stage's arithmetic: its backend and its weights' mode (``cpu:q8``, ``cuda:float16``)."""
    return f"{backend.name}:{backend.weights_dtype}"


@dataclass(frozen=True, slots=True)
class SeedStage:
    """One stage of a plan as the seed sees it."""

    node_id: str
    device: str  # the node's device kind (membership), or the host's backend_tag
    start: int
    end: int


def pipeline_seed(
    *,
    model: tuple[str, str],
    coordinator: str,
    dtypes: tuple[str, str, str],
    stages: Sequence[SeedStage],
) -> str:
    """The run's ``Load.prefix_seed``: ``model`` (ref, pin), the ``coordinator`` node,
    ``dtypes`` (KV, CPU, wire) and every stage of the plan, in order (module docstring)."""
    layout = [[s.node_id, s.device, s.start, s.end] for s in stages]
    return _digest("seed", list(model), coordinator, list(dtypes), layout)


def stage_identity(
    seed: str,
    *,
    coordinator: str,
    model: tuple[str, str],
    layers: tuple[int, int, bool, bool],
    kv_dtype: str,
    backend: Backend,
    context_size: int,
) -> str:
    """The identity of a stage's pool (module docstring): ``seed`` and what the stage
    loaded: ``model`` (ref, pin) as it prepared it, ``layers`` (start, end, embedding,
    head). Empty when ``seed`` is (an older host: the pool is never kept)."""
    if not seed:
        return ""
    parts = [coordinator, list(model), list(layers), kv_dtype, backend_tag(backend)]
    return _digest("stage", seed, *parts, context_size)


def host_seed(mesh: MeshView, settings: CoordinatorSettings, backend: Backend, placed: Plan) -> str:
    """The prefix seed of a run the host brings up on ``placed``: its own stage by its
    ``backend``'s arithmetic, every other by its node's device kind (membership)."""
    devices = {n.node_id: n.device for n in mesh.live_nodes()}
    devices[mesh.node_id] = backend_tag(backend)
    stages = [
        SeedStage(s.node_id, devices.get(s.node_id, ""), s.start, s.end) for s in placed.stages
    ]
    return pipeline_seed(
        model=(settings.model_ref, settings.pin),
        coordinator=mesh.node_id,
        dtypes=(settings.kv_dtype, settings.cpu_dtype, settings.wire_dtype),
        stages=stages,
    )


def host_identity(run: HostRun, stage: StagePlan) -> str:
    """The identity of the pool of ``run``'s stage 0 (``stage``), on the host."""
    settings = run.settings
    return stage_identity(
        run.prefix_seed,
        coordinator=run.mesh.node_id,
        model=(settings.model_ref, settings.pin),
        layers=(stage.start, stage.end, True, stage.head),
        kv_dtype=settings.kv_dtype,
        backend=run.backend,
        context_size=run.context_size,
    )


def take_over(
    kept: StagePrefix | None,
    identity: str,
    salt: str,
    context_size: int,
    sequences: int = MAX_SEQUENCES_PER_STAGE,
) -> StagePrefix | None:
    """``kept`` (an earlier run's pool) when the new stage, of ``identity`` and keyed by
    ``salt``, may take it over: the same stage of the same pipeline, a pool of the size its
    own would be (:func:`~meshnode.node.prefix.pool_blocks`), no sequence left in it."""
    if kept is None or kept.salt != salt:
        return None
    return kept if kept.reusable(identity, pool_blocks(context_size, sequences)) else None


def held_keys(prefix: StagePrefix) -> tuple[str, ...]:
    """What a stage reports in ``Ready.prefix_keys``: its cached blocks' keys, most
    recently used first, at most ``MAX_READY_PREFIX_KEYS``."""
    if prefix.pool is None:
        return ()
    return tuple(key.hex() for key in prefix.pool.held()[:MAX_READY_PREFIX_KEYS])


def common_keys(own: StagePrefix, remote: Sequence[Sequence[str]]) -> list[bytes]:
    """The keys of the blocks every stage holds: those of ``own`` (the host's stage) that
    every ``remote`` stage reported (``Ready.prefix_keys``), least recently used first
    (as :class:`~meshnode.node.prefix.PrefixIndex` keeps them)."""
    if own.pool is None:
        return []
    sets = [set(keys) for keys in remote]
    held = reversed(own.pool.held())
    return [key for key in held if all(key.hex() in s for s in sets)]


class HostRun(Protocol):
    """What :func:`host_identity` reads of a run being brought up (``BringUp``)."""

    mesh: MeshView
    settings: CoordinatorSettings
    prefix_seed: str
    backend: Backend
    context_size: int


@dataclass(frozen=True, slots=True)
class KeptPool:
    """A stopped run's pool a worker keeps for the next ``Load`` (its sequences released;
    ``prefix.identity`` says which stage it serves) of ``coordinator``'s."""

    prefix: StagePrefix
    coordinator: str
