"""Every message of the protocol, as frozen, slotted, typed records.

Field declaration order is wire order (the header map lists fields in this order) and the
table in ``protocol/README.md`` mirrors these classes. Rules:

- construction validates every field (``TypeError`` for a wrong type, ``ValueError`` for a
  bad value) and the cross-field rules in ``_validate``;
- fields may be added in later versions (with a default, so an older peer may omit them);
  a field's meaning never changes; unknown fields from a newer peer are ignored;
- control and data messages carry ``run_id`` and ``term`` (the coordinator's fencing token,
  DESIGN §3); membership messages (``Hello``, ``Heartbeat``, ``Goodbye``) do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from meshnode_protocol._fields import UInt, check_fields
from meshnode_protocol._tensor import DTYPE_SIZES, Tensor

PROTOCOL_VERSION: Final = 1
"""Wire version: bumped only for incompatible changes; additions go through ``features``."""

DEFAULT_FEATURES: Final[tuple[str, ...]] = ("bf16", "draft-distribution")
"""Optional capabilities this implementation offers in ``Hello.features``:

- ``bf16``: accepts bf16 tensors (activations with ``wire_dtype="bf16"``);
- ``draft-distribution``: accepts ``ActivationFrame.draft_probs`` as a ``[k, vocab]`` tensor
  (full draft distributions) rather than only a list of the drafted tokens' probabilities.

(``activation-batch``, :data:`BATCH_FEATURE`, is defined too; it is not in this default so
that the default ``Hello`` keeps its golden bytes.)
"""

BATCH_FEATURE: Final = "activation-batch"
"""The feature of a node that accepts ``ActivationBatch`` and ``PredictionBatch``."""

ACTIVATION_KINDS: Final = ("prefill", "decode", "verify")

Range = tuple[int, int]
"""A half-open layer range ``[start, end)``."""


class Record:
    """Base of every wire record: validates fields after the dataclass ``__init__``."""

    __slots__ = ()

    def __post_init__(self) -> None:
        check_fields(self)
        self._validate()

    def _validate(self) -> None:
        """Cross-field rules; raise ``ValueError``. Runs on construction and on decode."""


class Message(Record):
    """Base of every message; ``TYPE`` is the integer type tag in the frame header."""

    __slots__ = ()
    TYPE: ClassVar[int]


def _check_range(name: str, value: Range | None) -> None:
    if value is not None and not 0 <= value[0] <= value[1]:
        raise ValueError(f"{name} must be a range 0 <= start <= end, not {value}")


# -- records nested in messages ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo(Record):
    """A peer as other nodes see it: identity, mesh address ``host:port``, resources."""

    node_id: str
    address: str
    device_kind: str = ""
    usable_memory: UInt = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling(Record):
    """A request's sampling parameters (OpenAI semantics; 0 disables top_k, 1.0 top_p)."""

    temperature: float = 1.0
    top_k: UInt = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: UInt | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def _validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, not {self.repetition_penalty}")


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
        _check_range("layer_range", self.layer_range)


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
    ``free_memory`` now; ``measure_error``, why it could not measure. Claims: the
    coordinator bounds them (the codec checks only types)."""

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

    def _validate(self) -> None:
        for name in ("ready", "missing", "preparing"):
            for r in getattr(self, name):
                _check_range(name, r)


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
    it to the stage's own ``--dtype``.
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

    def _validate(self) -> None:
        _check_range("layer_range", self.layer_range)
        if self.wire_dtype not in DTYPE_SIZES:
            raise ValueError(f"wire_dtype must be one of {sorted(DTYPE_SIZES)}")
        if any(b <= 0 for b in self.batch_sizes):
            raise ValueError("batch_sizes must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """Node → coordinator: the stage is loaded and accepts activations at ``endpoint``.
    ``prefix_block`` is the block size of the stage's prefix cache (0: it keeps none, or
    the node predates the field); the host resumes requests from cached prefixes only
    when every stage of the run announces its own block size."""

    TYPE: ClassVar[int] = 18
    run_id: str
    term: UInt
    node_id: str
    endpoint: str
    layer_range: Range
    prefix_block: UInt = 0

    def _validate(self) -> None:
        _check_range("layer_range", self.layer_range)


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
        _check_range("layer_range", self.layer_range)


# -- data plane ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TopLogprobs(Record):
    """The most likely alternatives at one position: parallel token ids and log-probs."""

    token_ids: tuple[UInt, ...]
    logprobs: tuple[float, ...]

    def _validate(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationFrame(Message):
    """One pipeline pass of one request, from stage to stage.

    The frame's rows are ``tokens`` followed by ``draft_tokens``, at positions
    ``start_pos, start_pos + 1, …``; each stage first truncates the request's KV cache to
    ``start_pos`` (rollback needs no message). ``payload`` is the hidden state
    ``[rows, hidden]`` (``None`` only when the frame enters the first stage, which embeds
    ``tokens``). The last stage computes logits for the last ``out_rows`` rows and, when
    ``final``, answers the host with a ``Prediction`` (``final`` is false on all but the last
    chunk of a chunked prefill). ``sampling`` may be omitted after a request's first frame.
    ``draft_probs`` are the proposer's probabilities: one per draft token, or (feature
    ``draft-distribution``) a ``[k, vocab]`` tensor of full distributions.
    ``stage_compute_us`` is the compute time of each stage after the first that the frame
    has passed through, in order (each middle stage appends its own), so that the host can
    tell each stage's compute from wire time; empty on the frame stage 0 sends.
    ``grammar`` (llguidance's serialized grammar, sent on the frame at ``start_pos`` 0 only)
    constrains the tokens the last stage chooses for this request from position
    ``grammar_start`` (the prompt's length) on. ``prefix_key`` (16 bytes in 32 lowercase
    hex digits, on a request's
    first frame only, at ``start_pos > 0``; sent only to stages whose ``Ready`` announced a
    prefix cache) asks each stage to resume the new request from its cached prefix of
    ``start_pos`` tokens, whose last block has this hash-chain key; a stage that lacks it
    answers ``PREFIX_MISS`` and the host sends the request again from 0.
    """

    TYPE: ClassVar[int] = 30
    request_id: str
    run_id: str
    term: UInt
    kind: str
    start_pos: UInt
    tokens: tuple[UInt, ...]
    payload: Tensor | None = None
    sampling: Sampling | None = None
    draft_tokens: tuple[UInt, ...] = ()
    draft_probs: Tensor | tuple[float, ...] | None = None
    out_rows: UInt = 1
    final: bool = True
    logprobs: bool = False
    top_logprobs: UInt = 0
    stage_compute_us: tuple[UInt, ...] = ()
    mtp_drafts: UInt = 0
    grammar: str | None = None
    grammar_start: UInt = 0
    prefix_key: str | None = None

    def _validate(self) -> None:
        key = self.prefix_key
        if key is not None and not (_is_key(key) and self.start_pos > 0):
            raise ValueError("prefix_key is 32 lowercase hex digits, at start_pos > 0")
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"kind must be one of {ACTIVATION_KINDS}, not {self.kind!r}")
        rows = len(self.tokens) + len(self.draft_tokens)
        if self.draft_tokens and self.kind != "verify":
            raise ValueError("draft_tokens are only sent with kind='verify'")
        if self.payload is not None and self.payload.shape[:1] != (rows,):
            raise ValueError(f"payload has shape {self.payload.shape}, expected {rows} rows")
        if self.out_rows > rows:
            raise ValueError(f"out_rows={self.out_rows} exceeds the frame's {rows} rows")
        self._validate_draft_probs()

    def _validate_draft_probs(self) -> None:
        probs = self.draft_probs
        if probs is None:
            return
        k = len(self.draft_tokens)
        if isinstance(probs, Tensor):
            if len(probs.shape) != 2:
                raise ValueError("draft_probs as a tensor must be [k, vocab]")
            count = probs.shape[0]
        else:
            count = len(probs)
        if count != k:
            raise ValueError(f"draft_probs has {count} rows for {k} draft tokens")

    @property
    def rows(self) -> int:
        """Number of positions in this frame: ``len(tokens) + len(draft_tokens)``."""
        return len(self.tokens) + len(self.draft_tokens)


def _is_key(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction(Message):
    """Last stage → host: ``accepted`` draft tokens were accepted, then one new token.

    ``tokens`` are what the host appends, starting at position ``start_pos``: the accepted
    drafts followed by the token sampled from the target (so ``accepted < len(tokens)``).
    ``logprobs``, when asked for, holds one log-probability per token, and
    ``top_logprobs`` (when the frame asked for ``top_logprobs > 0``) the alternatives at each
    token's position. ``compute_us`` is the last stage's compute time and
    ``stage_compute_us`` that of each stage between the first and the last, in order (copied
    from the frame), so the host can tell each stage's compute from wire time.
    ``drafts`` are the MTP module's guesses of the tokens after ``tokens`` (when the frame
    asked for ``mtp_drafts``), for the host to verify in its next frame.
    """

    TYPE: ClassVar[int] = 31
    request_id: str
    run_id: str
    term: UInt
    start_pos: UInt
    accepted: UInt
    tokens: tuple[UInt, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()
    compute_us: UInt = 0
    stage_compute_us: tuple[UInt, ...] = ()
    drafts: tuple[UInt, ...] = ()

    def _validate(self) -> None:
        if not self.accepted < len(self.tokens):
            raise ValueError(f"accepted={self.accepted} needs more than that many tokens")
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError("logprobs must hold one value per token")
        if self.top_logprobs and len(self.top_logprobs) != len(self.tokens):
            raise ValueError("top_logprobs must hold one entry per token")


@dataclass(frozen=True, slots=True, kw_only=True)
class Release(Message):
    """Host → every stage: the request ended; free its KV cache."""

    TYPE: ClassVar[int] = 32
    request_id: str
    run_id: str
    term: UInt


#: Frames (or predictions) in one batch message. A step carries at most one frame per
#: sequence and a stage holds a few dozen sequences at most; the bound keeps a hostile
#: header from making the receiver build an unbounded list of records.
MAX_BATCH_FRAMES: Final = 256


def _check_batch(
    name: str, items: tuple[ActivationFrame, ...] | tuple[Prediction, ...], run_id: str, term: int
) -> None:
    if not 1 <= len(items) <= MAX_BATCH_FRAMES:
        raise ValueError(f"a batch carries 1 to {MAX_BATCH_FRAMES} {name}, not {len(items)}")
    if any(item.run_id != run_id or item.term != term for item in items):
        raise ValueError(f"every one of a batch's {name} names the batch's run and term")
    if len({item.request_id for item in items}) != len(items):
        raise ValueError(f"a batch carries at most one of its {name} per request")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationBatch(Message):
    """One pipeline step of several requests, from stage to stage as one message
    (feature ``activation-batch``).

    Each of ``frames`` means exactly what it means alone, and the receiving stage runs them
    as one multi-row forward; their payloads follow one another in the frame's raw payload,
    in order. At most one frame per request, all of this ``run_id`` and ``term``. The next
    stage receives the step as a batch again; the last stage answers with one
    ``PredictionBatch`` for the frames that want a token.
    """

    TYPE: ClassVar[int] = 33
    run_id: str
    term: UInt
    frames: tuple[ActivationFrame, ...]

    def _validate(self) -> None:
        _check_batch("frames", self.frames, self.run_id, self.term)


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictionBatch(Message):
    """Last stage → host: the ``Prediction`` of each final frame of one ``ActivationBatch``
    (feature ``activation-batch``), each meaning what it means alone."""

    TYPE: ClassVar[int] = 34
    run_id: str
    term: UInt
    predictions: tuple[Prediction, ...]

    def _validate(self) -> None:
        _check_batch("predictions", self.predictions, self.run_id, self.term)


MESSAGE_TYPES: Final[dict[int, type[Message]]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Goodbye, Heartbeat, Error,
        Claim, ClaimAccepted, ClaimRejected, Prepare, PrepareAccepted, Inventory,
        InventoryReport, Load, Ready, Stop, Status,
        ActivationFrame, Prediction, Release, ActivationBatch, PredictionBatch,
    )
}  # fmt: skip
"""Type tag → message class; a tag not in this table is ``UNKNOWN_MESSAGE_TYPE``."""
