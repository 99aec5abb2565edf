"""Cached prefixes that outlive a run (issue 30): a replay reuses what the stages still hold.

When a stage is lost, or a pass is, the host brings up a new run and replays the requests
in flight on it (:mod:`meshnode.generation.replay`). Every run used to seed the hash
chain of its stages' cached blocks with its run id, so a new run found nothing to reuse.

**The seeds.** The chain is seeded instead by each stage's own *prefix seed*
(``Load.prefix_seed``, :func:`stage_seeds`): a digest of what changes *that* stage's K/V
bits, as the host plans it: the model and its pin, the KV, CPU and wire dtypes, the
arithmetic of every layer up to the stage's end (each range's device kind, the host's own
arithmetic for its stage), where the upstream cuts fall when the wire dtype rounds (f16,
bf16: a hidden state crossing a cut is rounded there; float32 crosses it unchanged, so
the cuts between stages of one device do not count), the stage's own range, and the host
(a host's blocks are never another host's, whose requests could then probe for its
prompts). Not the nodes, nor anything downstream. Whatever else changes, a block's K/V
does not: the same seed means the same bits for the same tokens. So after a re-plan (a
stage killed, its range given to a spare) every stage whose range and upstream
arithmetic are unchanged keeps its blocks, and one whose range, or anything upstream of
it, changed never finds a block of the old plan, whose key differs.

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
(``Ready.prefix_keys``, :func:`held_keys`); the host believes them stage by stage, its
own included (:func:`kept_keys`), and resumes a replayed (or new) request on each stage
from what that stage and every stage after it hold
(:meth:`~meshnode.node.prefix.PrefixIndex.resume_point`: a stage computes its rows from
its start on for the next one, so no stage may start after the one that follows it). A
belief that turns out wrong costs one ``PREFIX_MISS`` and a prefill from 0, as before.

Residual: a seed names a remote node's device kind, not the node, its CUDA weight dtype
or its CPU's instruction set: a stage whose upstream layers a re-plan moved to another
node of the same kind keeps blocks computed from the old node's hidden states, and the
suffix it computes next reads the new node's. Where the two machines round a sum
otherwise (numpy's or BLAS's vector width on another CPU, a CUDA node restarted with
another ``--dtype``) those differ in their last bits: a resumed request is then its
uncached twin's to float rounding, not bit for bit (as the exact mode's short pieces are,
docs/api.md "Prefix caching").
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
    "LOSSLESS_WIRE",
    "KeptPool",
    "SeedStage",
    "backend_tag",
    "held_keys",
    "host_identity",
    "host_seeds",
    "kept_keys",
    "stage_identity",
    "stage_seeds",
    "take_over",
]

#: How long a worker keeps a stopped run's pool for the next ``Load`` of the same stage:
#: a replay waits at most this long for its next pipeline (``REPLAY_WAIT_S``), and a pool
#: nobody reloads holds a stage's KV memory for nothing.
KEEP_POOL_S = 120.0
#: Bumped when what a seed or identity digests changes meaning.
_VERSION = "meshnode-prefix-2"


def _digest(*parts: object) -> str:
    """16 bytes of BLAKE2b over ``parts`` (JSON: unambiguous), as 32 lowercase hex digits."""
    text = json.dumps([_VERSION, *parts], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def backend_tag(backend: Backend) -> str:
    """A stage's arithmetic: its backend and its weights' mode (``cpu:q8``, ``cuda:float16``)."""
    return f"{backend.name}:{backend.weights_dtype}"


#: Wire dtypes a hidden state crosses a cut in unchanged: the engine's activations are
#: float32, so a stage after the cut reads the bits the unsplit model's next layer would
#: (``tests/engine/test_q8_same_bits.py``, ``tests/engine/test_wire_cuts.py``). f16 and bf16
#: round them: where a lossy cut falls changes every later stage's bits.
LOSSLESS_WIRE = frozenset({"f32"})


@dataclass(frozen=True, slots=True)
class SeedStage:
    """One stage of a plan as the seeds see it: the arithmetic of its layers (``device``:
    the node's device kind from membership, or the host's :func:`backend_tag`) and its
    range. Not the node: a spare that computes the same layers the same way computes the
    same bits."""

    device: str
    start: int
    end: int


def stage_seeds(
    *,
    model: tuple[str, str],
    coordinator: str,
    dtypes: tuple[str, str, str],
    stages: Sequence[SeedStage],
) -> tuple[str, ...]:
    """Each stage's ``Load.prefix_seed`` (module docstring): ``model`` (ref, pin), the
    ``coordinator``, ``dtypes`` (KV, CPU, wire), the arithmetic of every layer before the
    stage, by device and range, with the cuts between them only when the wire dtype
    rounds (:data:`LOSSLESS_WIRE`: there, consecutive ranges of one device are one), and
    the stage's own device and range."""
    lossless = dtypes[2] in LOSSLESS_WIRE
    upstream: list[list[object]] = []  # [device, start, end] of the layers before a stage
    seeds = []
    for stage in stages:
        own = [stage.device, stage.start, stage.end]
        seeds.append(_digest("stage-seed", list(model), coordinator, list(dtypes), upstream, own))
        if lossless and upstream and upstream[-1][0] == stage.device:
            upstream = [*upstream[:-1], [stage.device, upstream[-1][1], stage.end]]
        else:
            upstream = [*upstream, own]
    return tuple(seeds)


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


def host_seeds(
    mesh: MeshView, settings: CoordinatorSettings, backend: Backend, placed: Plan
) -> tuple[str, ...]:
    """The prefix seed of each stage of a run the host brings up on ``placed``: its own
    stage by its ``backend``'s arithmetic, every other by its node's device kind."""
    devices = {n.node_id: n.device for n in mesh.live_nodes()}
    devices[mesh.node_id] = backend_tag(backend)
    stages = [SeedStage(devices.get(s.node_id, ""), s.start, s.end) for s in placed.stages]
    return stage_seeds(
        model=(settings.model_ref, settings.pin),
        coordinator=mesh.node_id,
        dtypes=(settings.kv_dtype, settings.cpu_dtype, settings.wire_dtype),
        stages=stages,
    )


def host_identity(run: HostRun, stage: StagePlan) -> str:
    """The identity of the pool of ``run``'s stage 0 (``stage``), on the host."""
    settings = run.settings
    return stage_identity(
        run.prefix_seeds[0],
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


def kept_keys(own: StagePrefix, remote: Sequence[Sequence[str]]) -> list[bytes]:
    """The keys of the blocks the stages kept (each stage's own: their seeds differ), least
    recently used first: ``own``'s (the host's stage 0) and each ``remote`` stage's
    (``Ready.prefix_keys``, most recent first, checked as the message was decoded)."""
    keys = [] if own.pool is None else list(reversed(own.pool.held()))
    for held in remote:
        keys += [bytes.fromhex(key) for key in reversed(held)]
    return keys


class HostRun(Protocol):
    """What :func:`host_identity` reads of a run being brought up (``BringUp``)."""

    mesh: MeshView
    settings: CoordinatorSettings
    prefix_seeds: tuple[str, ...]
    backend: Backend
    context_size: int


@dataclass(frozen=True, slots=True)
class KeptPool:
    """A stopped run's pool a worker keeps for the next ``Load`` (its sequences released;
    ``prefix.identity`` says which stage it serves) of ``coordinator``'s."""

    prefix: StagePrefix
    coordinator: str
