"""meshnode's wire protocol, sans-IO: framing, typed messages, the ``Connection`` codec.

The specification is ``protocol/README.md``; golden frames are in ``protocol/vectors/``.
Layering (lower never imports higher): ``_errors``, ``_tensor`` → ``_fields`` →
``_messages`` → ``_framing``, ``_state`` → ``_connection``. Depends on ``cbor2`` only.
"""

from meshnode_protocol._connection import (
    CONNECTION_CLOSED,
    NEED_DATA,
    Connection,
    ConnectionClosed,
    NeedData,
    Signal,
)
from meshnode_protocol._errors import (
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from meshnode_protocol._framing import MAX_FRAME_BYTES, MAX_HEADER_BYTES, decode_frame, encode_frame
from meshnode_protocol._messages import (
    ACTIVATION_KINDS,
    DEFAULT_FEATURES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ActivationFrame,
    Claim,
    ClaimAccepted,
    ClaimRejected,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Inventory,
    InventoryReport,
    Load,
    Message,
    PeerInfo,
    Prediction,
    Prepare,
    PrepareAccepted,
    Ready,
    Record,
    Release,
    Sampling,
    Status,
    Stop,
)
from meshnode_protocol._state import Role, State
from meshnode_protocol._tensor import DTYPE_SIZES, Tensor

__all__ = [
    "ACTIVATION_KINDS",
    "CONNECTION_CLOSED",
    "DEFAULT_FEATURES",
    "DTYPE_SIZES",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MESSAGE_TYPES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "ActivationFrame",
    "Claim",
    "ClaimAccepted",
    "ClaimRejected",
    "Connection",
    "ConnectionClosed",
    "Error",
    "ErrorCode",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Inventory",
    "InventoryReport",
    "Load",
    "LocalProtocolError",
    "Message",
    "NeedData",
    "PeerInfo",
    "Prediction",
    "Prepare",
    "PrepareAccepted",
    "ProtocolError",
    "Ready",
    "Record",
    "Release",
    "RemoteProtocolError",
    "Role",
    "Sampling",
    "Signal",
    "State",
    "Status",
    "Stop",
    "Tensor",
    "decode_frame",
    "encode_frame",
]
