"""The protocol's version and features, the bases of every wire record, and the records
nested in messages (:class:`PeerInfo`, :class:`PeerLink`, :class:`Sampling`).

The messages themselves are in ``_control`` (membership and the run's bring-up) and
``_data`` (the data plane); ``_messages`` gathers them and their type tags.

Field declaration order is wire order (the header map lists fields in this order) and the
table in ``protocol/README.md`` mirrors these classes. Rules:

- construction validates every field (``TypeError`` for a wrong type, ``ValueError`` for a
  bad value) and the cross-field rules in ``_validate``;
- fields may be added in later versions (with a default, so an older peer may omit them);
  a field's meaning never changes; unknown fields from a newer peer are ignored;
- control and data messages carry ``run_id`` and ``term`` (the coordinator's fencing token,
  DESIGN §3); membership messages (``Hello``, ``Heartbeat``, ``Goodbye``, ``LinkProbe``,
  ``LinkProbeReply``) do not, nor do ``SpeedQuery`` and ``SpeedReport`` (asked before any
  run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from meshnode_protocol._fields import UInt, check_fields

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

LINK_PROBE_FEATURE: Final = "link-probe"
"""The feature of a node that answers ``LinkProbe`` (not in the default either: a peer
that lacks it is never probed, since an unknown message type closes its session)."""

SPEED_QUERY_FEATURE: Final = "speed-query"
"""The feature of a node that answers ``SpeedQuery`` with a ``SpeedReport`` (not in the
default: an older peer is never asked, since an unknown message type closes its session)."""

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


def check_range(name: str, value: Range | None) -> None:
    if value is not None and not 0 <= value[0] <= value[1]:
        raise ValueError(f"{name} must be a range 0 <= start <= end, not {value}")


def is_key(text: str) -> bool:
    """Whether ``text`` is a prefix-cache key on the wire: 16 bytes as 32 lowercase hex."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


# -- records nested in messages ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo(Record):
    """A peer as other nodes see it: identity, mesh address ``host:port``, resources."""

    node_id: str
    address: str
    device_kind: str = ""
    usable_memory: UInt = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerLink(Record):
    """A node's measured link to one of its peers (issue 34): the heartbeat's round trip in
    µs and the link probe's rate in bytes a second (0: not measured). Claims: the receiver
    bounds them (the codec checks only types)."""

    node_id: str
    rtt_us: float = 0.0
    bytes_per_s: float = 0.0


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
