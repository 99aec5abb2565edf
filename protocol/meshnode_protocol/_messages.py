"""Every message of the protocol, as frozen, slotted, typed records, and their type tags.

The records live in three modules cut at the protocol's own seams: ``_records`` (the
version, features, bases and nested records, with the rules every record follows),
``_control`` (membership and a run's bring-up) and ``_data`` (the data plane). This module
gathers them under one name, so ``meshnode_protocol._messages`` is where a caller finds any
message, and holds :data:`MESSAGE_TYPES`.
"""

from __future__ import annotations

from typing import Final

from meshnode_protocol._control import (
    MAX_READY_PREFIX_KEYS,
    Claim,
    ClaimAccepted,
    ClaimRejected,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Inventory,
    InventoryReport,
    LinkProbe,
    LinkProbeReply,
    Load,
    Prepare,
    PrepareAccepted,
    Ready,
    SpeedQuery,
    SpeedReport,
    Status,
    Stop,
)
from meshnode_protocol._data import (
    MAX_BATCH_FRAMES,
    MAX_RESUME_STAGES,
    ActivationBatch,
    ActivationFrame,
    Prediction,
    PredictionBatch,
    Release,
    TopLogprobs,
)
from meshnode_protocol._records import (
    ACTIVATION_KINDS,
    BATCH_FEATURE,
    DEFAULT_FEATURES,
    LINK_PROBE_FEATURE,
    PROTOCOL_VERSION,
    SPEED_QUERY_FEATURE,
    Message,
    PeerInfo,
    PeerLink,
    Range,
    Record,
    Sampling,
)

__all__ = [
    "ACTIVATION_KINDS",
    "BATCH_FEATURE",
    "DEFAULT_FEATURES",
    "LINK_PROBE_FEATURE",
    "MAX_BATCH_FRAMES",
    "MAX_READY_PREFIX_KEYS",
    "MAX_RESUME_STAGES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SPEED_QUERY_FEATURE",
    "ActivationBatch",
    "ActivationFrame",
    "Claim",
    "ClaimAccepted",
    "ClaimRejected",
    "Error",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Inventory",
    "InventoryReport",
    "LinkProbe",
    "LinkProbeReply",
    "Load",
    "Message",
    "PeerInfo",
    "PeerLink",
    "Prediction",
    "PredictionBatch",
    "Prepare",
    "PrepareAccepted",
    "Range",
    "Ready",
    "Record",
    "Release",
    "Sampling",
    "SpeedQuery",
    "SpeedReport",
    "Status",
    "Stop",
    "TopLogprobs",
]

MESSAGE_TYPES: Final[dict[int, type[Message]]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Goodbye, Heartbeat, Error, LinkProbe, LinkProbeReply,
        Claim, ClaimAccepted, ClaimRejected, Prepare, PrepareAccepted, Inventory,
        InventoryReport, Load, Ready, Stop, Status, SpeedQuery, SpeedReport,
        ActivationFrame, Prediction, Release, ActivationBatch, PredictionBatch,
    )
}  # fmt: skip
"""Type tag → message class; a tag not in this table is ``UNKNOWN_MESSAGE_TYPE``."""
