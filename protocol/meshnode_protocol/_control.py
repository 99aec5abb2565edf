"""Membership and control-plane messages: who a peer is and is it alive, and a run's
bring-up (claim, prepare, inventory, load, ready, stop, status). The rules of every record
are in ``_records``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshnode_protocol._fields import UInt
from meshnode_protocol._records import (
    DEFAULT_FEATURES,
    PROTOCOL_VERSION,
    Message,
    PeerInfo,
    PeerLink,
    Range,
    check_range,
    is_key,
)
from meshnode_protocol._tensor import DTYPE_SIZES, Tensor

#: Keys a ``Ready`` reports: 33 bytes each in CBOR, so 1,024 take 34 KiB of the header's
#: 64 KiB (``MAX_HEADER_BYTES``); a pool of four 4,096-token contexts in blocks of 16.
MAX_READY_PREFIX_KEYS = 1024

# -- membership ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """First message in each direction: who we are and what we speak."""

    TYPE: ClassVar[int] = 1
    protocol_version: UInt = PROTOCOL_VERSION
    features: tuple[str, ...] = DEFAULT_FEATURES
    node_id: str
    mesh_id_hash: str
    listen_address: str
    device_kind: str
    usable_memory: UInt
    known_peers: tuple[PeerInfo, ...] = ()
    api_address: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye(Message):
    """Clean shutdown: the sender closes after this; peers drop it at once (not 'dead')."""

    TYPE: ClassVar[int] = 2
    node_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Liveness and round-trip time.

    ``sent_ns`` is the sender's monotonic clock. A heartbeat with ``echo_nonce`` unset is
    answered by one that copies its ``nonce``/``sent_ns`` into ``echo_nonce``/``echo_sent_ns``;
    the original sender's RTT is then ``now - echo_sent_ns`` on its own clock (no clock sync).
    Answers are never answered.
    """

    TYPE: ClassVar[int] = 3
    node_id: str
    nonce: int
    sent_ns: int
    echo_nonce: int | None = None
    echo_sent_ns: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Message):
    """A refusal (``code`` is an ``ErrorCode``); ``fatal`` means the sender closes next."""

    TYPE: ClassVar[int] = 4
    code: UInt
    message: str
    fatal: bool = False
    run_id: str = ""
    term: UInt = 0
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkProbe(Message):
    """A link's bandwidth, timed by its sender (issue 34): answered at once by a
    ``LinkProbeReply`` with the same ``nonce``.

    ``payload`` is padding, its values never read: the sender times an empty probe and
    one of ``n`` bytes and takes ``n`` over the difference as the link's rate, so the
    round trip cancels out. A node answers a bounded number of probes per peer.
    """

    TYPE: ClassVar[int] = 5
    node_id: str
    nonce: UInt
    payload: Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkProbeReply(Message):
    """The answer to a ``LinkProbe``: its ``nonce`` and the padding bytes it carried."""

    TYPE: ClassVar[int] = 6
    node_id: str
    nonce: UInt
    received_bytes: UInt = 0


# -- control plane ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim(Message):
    """Coordinator → node: reserve yourself for run ``run_id`` at ``term``."""

    TYPE: ClassVar[int] = 10
    run_id: str
    term: UInt
    coordinator_id: str
    package_ref: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimAccepted(Message):
    """Node → coordinator: claimed; these are the resources it offers the run."""

    TYPE: ClassVar[int] = 11
    run_id: str
    term: UInt
    node_id: str
    device_kind: str = ""
    usable_memory: UInt = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimRejected(Message):
    """Node → coordinator: not claimed (e.g. held by a newer term); ``held_by_*`` say by whom."""

    TYPE: ClassVar[int] = 12
    run_id: str
    term: UInt
    node_id: str
    reason: str
    held_by_run: str = ""
    held_by_term: UInt = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare(Message):
    """Coordinator → node: materialize this part of a package in the background."""

    TYPE: ClassVar[int] = 13
    run_id: str
    term: UInt
    package_ref: str
    manifest_sha256: str
    layer_range: Range
    has_embed: bool
    has_head: bool
    # The hub commit (40 lowercase hex digits) the host resolved ``package_ref``'s revision
    # to; every stage reads exactly that commit. Empty: the reference has no revision. Its
    # form is the application's to check (a stage refuses a malformed one), not the codec's.
    commit: str = ""

    def _validate(self) -> None:
        check_range("layer_range", self.layer_range)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareAccepted(Message):
    """Node → coordinator: preparing; progress is visible through ``Inventory``."""

    TYPE: ClassVar[int] = 14
    run_id: str
    term: UInt
    node_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Inventory(Message):
    """Coordinator → node: report what you hold of this package."""

    TYPE: ClassVar[int] = 15
    run_id: str
    term: UInt
    package_ref: str
    manifest_sha256: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class InventoryReport(Message):
    """Node → coordinator: layer ranges ready / missing / being prepared, and byte progress;
    once loaded, ``busy_ms``: how long its compute pass in progress has run (0: idle).

    Once prepared, what the node measured of itself for this model (issue 34; 0 and
    empty: not measured): per layer and token, ``decode_us`` (one row), ``batch_us`` (eight
    rows in one pass, per row), ``prefill_us`` (a prompt chunk, per row), over a layer of
    ``layer_bytes`` weight bytes; ``disk_bytes_per_s``, the model file's read rate;
    ``free_memory`` now; ``measure_error``, why it could not measure. ``links``: the node's
    measured links to its peers (round trip and rate), so that the planner can time the
    hop between two workers' stages. Claims: the coordinator bounds them (the codec checks
    only types)."""

    TYPE: ClassVar[int] = 16
    run_id: str
    term: UInt
    node_id: str
    package_ref: str
    ready: tuple[Range, ...] = ()
    missing: tuple[Range, ...] = ()
    preparing: tuple[Range, ...] = ()
    embed_ready: bool = False
    head_ready: bool = False
    bytes_done: UInt = 0
    bytes_total: UInt = 0
    error: str = ""
    busy_ms: UInt = 0
    decode_us: float = 0.0
    batch_us: float = 0.0
    prefill_us: float = 0.0
    layer_bytes: UInt = 0
    disk_bytes_per_s: float = 0.0
    free_memory: UInt = 0
    measure_error: str = ""
    links: tuple[PeerLink, ...] = ()

    def _validate(self) -> None:
        for name in ("ready", "missing", "preparing"):
            for r in getattr(self, name):
                check_range(name, r)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeedQuery(Message):
    """Host → node, before its first plan (feature ``speed-query``): what the node has
    already measured of itself for this model (issue 34), answered at once by a
    ``SpeedReport`` with the same ``nonce``. No claim is needed; it carries no run.

    ``package_ref`` and ``pin`` are what the host would ``Prepare``: the reference and the
    hub commit or manifest sha256 it resolved it to (empty: none). ``peers``: the other
    nodes the host may plan over; the node connects to those it has no session with and
    measures its links to them, and sends a new ``SpeedReport`` (same ``nonce``) each
    time it has measured one, so that the host can time the hops between workers' stages
    before it places them. The host sends a node another query when the peers change."""

    TYPE: ClassVar[int] = 21
    node_id: str
    nonce: UInt
    package_ref: str
    pin: str = ""
    peers: tuple[PeerInfo, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeedReport(Message):
    """Node → host: the answer to a ``SpeedQuery``; the fields of an ``InventoryReport``'s
    measurement, of the layer ``layer`` it timed. ``decode_us`` 0: nothing measured (the
    node's cache holds no measurement for this model on this machine). ``links`` as in an
    ``InventoryReport``, measured or not. ``measuring``: the node, holding no measurement,
    measures itself for this model now and answers again (same ``nonce``) when done.
    Claims: the host bounds them as it bounds an ``InventoryReport``'s (the codec checks
    only types)."""

    TYPE: ClassVar[int] = 22
    node_id: str
    nonce: UInt
    package_ref: str
    layer: UInt = 0
    decode_us: float = 0.0
    batch_us: float = 0.0
    prefill_us: float = 0.0
    layer_bytes: UInt = 0
    disk_bytes_per_s: float = 0.0
    links: tuple[PeerLink, ...] = ()
    measuring: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Load(Message):
    """Coordinator → node: load a stage (sent downstream-first; answered by ``Ready``).

    ``upstream`` is the stage that sends us activations (``None`` on stage 0);
    ``downstream`` is where our output goes: the next stage, or, on the last stage, the
    host (stage 0), which receives ``Prediction`` frames directly. ``ring_slots`` is how
    many per-row recurrent-state snapshots a hybrid stage keeps per sequence (the largest
    verify pass the host will send: its largest window plus one); 0 leaves it to the stage.
    ``cpu_dtype`` is the arithmetic of the host's CPU stages, which a CPU stage that keeps
    GGUF blocks takes too: ``native`` (exact) or ``q8`` (8-bit activations); empty leaves
    it to the stage's own ``--dtype``. ``prefix_seed`` (32 lowercase hex digits; empty: the
    run id) seeds the hash chain that keys the stage's cached prefix blocks: the host
    derives it from what changes this stage's K/V (model and pin, dtypes, the device kind
    of the layers before it and its own range; the cuts before it when the wire dtype
    rounds), not from the run nor the nodes, so that a stage re-loaded with the same
    arithmetic up to its layers keeps its cached blocks and a replay resumes from them.
    """

    TYPE: ClassVar[int] = 17
    run_id: str
    term: UInt
    package_ref: str
    manifest_sha256: str
    layer_range: Range
    has_embed: bool
    has_head: bool
    upstream: PeerInfo | None = None
    downstream: PeerInfo | None = None
    wire_dtype: str = "f16"
    context_size: UInt
    batch_sizes: tuple[UInt, ...] = (1,)
    kv_dtype: str = "f16"
    ring_slots: UInt = 0
    cpu_dtype: str = ""
    prefix_seed: str = ""

    def _validate(self) -> None:
        check_range("layer_range", self.layer_range)
        if self.prefix_seed and not is_key(self.prefix_seed):
            raise ValueError("prefix_seed is 32 lowercase hex digits")
        if self.wire_dtype not in DTYPE_SIZES:
            raise ValueError(f"wire_dtype must be one of {sorted(DTYPE_SIZES)}")
        if any(b <= 0 for b in self.batch_sizes):
            raise ValueError("batch_sizes must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """Node → coordinator: the stage is loaded and accepts activations at ``endpoint``.
    ``prefix_block`` is the block size of the stage's prefix cache (0: it keeps none, or
    the node predates the field); the host resumes requests from cached prefixes only
    when every stage of the run announces its own block size. ``prefix_seed`` echoes the
    ``Load``'s (the stage keys its blocks with it; empty: with the run id) and
    ``prefix_keys`` are the keys (32 lowercase hex digits each) of the cached blocks the
    stage kept from an earlier load of the same pipeline, most recently used first, at most
    ``MAX_READY_PREFIX_KEYS``: the host resumes a replayed request on each stage from the
    prefix it and the stages after it still hold."""

    TYPE: ClassVar[int] = 18
    run_id: str
    term: UInt
    node_id: str
    endpoint: str
    layer_range: Range
    prefix_block: UInt = 0
    prefix_seed: str = ""
    prefix_keys: tuple[str, ...] = ()

    def _validate(self) -> None:
        check_range("layer_range", self.layer_range)
        if self.prefix_seed and not is_key(self.prefix_seed):
            raise ValueError("prefix_seed is 32 lowercase hex digits")
        if len(self.prefix_keys) > MAX_READY_PREFIX_KEYS:
            raise ValueError(f"more than {MAX_READY_PREFIX_KEYS} prefix_keys")
        if not all(is_key(k) for k in self.prefix_keys):
            raise ValueError("each of prefix_keys is 32 lowercase hex digits")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop(Message):
    """Coordinator → node: drop everything of this run (stage, caches, claim)."""

    TYPE: ClassVar[int] = 19
    run_id: str
    term: UInt
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Status(Message):
    """Node → anyone: its current state (idle, claimed, preparing, loading, ready, stopping)."""

    TYPE: ClassVar[int] = 20
    node_id: str
    state: str
    run_id: str = ""
    term: UInt = 0
    layer_range: Range | None = None
    detail: str = ""

    def _validate(self) -> None:
        check_range("layer_range", self.layer_range)
