"""What the host's coordinator needs of the mesh and of its settings: the
:class:`MeshView` the daemon implements, and the :class:`CoordinatorSettings` the CLI
resolves. Apart from the coordinator (:mod:`meshnode.node.coordinator`) so that the
bring-up (:mod:`meshnode.node.bringup`), which the coordinator drives, reads them without
importing its driver back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio
from meshnode_protocol import Message, PeerInfo

from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.node.config import DEFAULT_SUSPECT_GRACE_S
from meshnode.node.planner import NodeCapacity
from meshnode.node.remote import PassDeadline


class MeshView(Protocol):
    """What the coordinator needs of the running node (the daemon implements it)."""

    @property
    def node_id(self) -> str:
        """This node's id."""
        ...

    def live_nodes(self) -> list[NodeCapacity]:
        """This node and every alive, connected peer."""
        ...

    def suspects(self) -> Mapping[str, float]:
        """Connected peers the membership holds suspect, with the trio time each became so
        (they are not in :meth:`live_nodes`; :mod:`meshnode.node.watch` decides when a
        suspect stage is lost)."""
        ...

    def peer_info(self, node_id: str) -> PeerInfo:
        """Address and capacity of a node (this one included), for ``Load``."""
        ...

    async def send(self, node_id: str, message: Message) -> None:
        """Send to a peer over its session; raises if there is none."""
        ...

    def membership_event(self) -> trio.Event:
        """The event the next membership change sets. Take it before reading
        :meth:`live_nodes` and wait on it after: a change in between is not missed."""
        ...


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """The host's choices for placing its model (``meshnode join --model`` and its flags)."""

    model_ref: str
    context_size: int | None = None
    split: int | None = None
    wire_dtype: str = "f16"
    # K/V of every stage's caches (``Load.kv_dtype``): f32 or f16, ``--kv-dtype`` resolved
    # by the host (``engine.kv_cache.resolve_kv_dtype``: auto is f16 with q8 weights)
    kv_dtype: str = "f32"
    # The arithmetic of the host's CPU stages, which every CPU stage keeping GGUF blocks
    # takes (``Load.cpu_dtype``, ``stage_build.run_backend``): native, q8, or "" (a CUDA host
    # in float16/bfloat16: each stage its own)
    cpu_dtype: str = ""
    cache_dir: Path | None = None
    # What the host resolved ``model_ref`` to (``refs.pin_ref``): a hub commit or a URL
    # package's manifest sha256, sent in every Prepare so that no stage reads another one.
    pin: str = ""
    # Per-sequence recurrent-state snapshots each hybrid stage keeps (``Load.ring_slots``):
    # the host's largest verify pass (``engine.recurrent.ring_slots_for``).
    ring_slots: int = DEFAULT_RING_SLOTS
    # When a pass across the stages counts as lost (``--pass-deadline``).
    pass_deadline: PassDeadline = field(default_factory=PassDeadline)
    # How long a stage's node stays suspect, its passes stalled, before the stage is dropped
    # (``--suspect-grace``: ``meshnode.node.membership.suspect_lost_at``).
    suspect_grace_s: float = DEFAULT_SUSPECT_GRACE_S
    # Time every stage of a new pipeline before it serves (node/calibrate.py). ``join``
    # always does; tests of other concerns leave it off, so their passes are their own.
    calibrate: bool = False
    # Whether plans use the measured speeds (``--placement speed``) or memory alone.
    place_by_speed: bool = True
    # Serve weights past the mesh's memory from disk when nothing else fits (planner,
    # Larger than memory). ``join`` does unless ``--no-disk-offload``; tests of other
    # concerns leave it off, so a mesh short of memory waits for nodes there.
    disk_offload: bool = False
