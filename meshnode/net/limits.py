"""Bounds on what the network can make a node hold or do, and rate-limited refusal logs.

mDNS adverts are unauthenticated: anyone on the LAN can advertise any number of records
for our mesh id (it is public), and each one used to become a dial target, dialed for ever
with backoff. Anyone can also open TCP connections to the mesh port, and each one used to
get a TLS handshake task. These limits cap both; what is refused is counted and logged at
most once per interval, so a flood cannot fill the disk with log lines either.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Final

#: Seconds a new inbound connection has to send its first bytes: a dialer's TLS ClientHello
#: follows the TCP handshake at once (milliseconds on a LAN, well under a second on a loaded
#: machine); an idle connection is dropped after this, not after the 5 s handshake timeout.
CLIENT_HELLO_TIMEOUT_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class MeshLimits:
    """How much of each resource the network may claim (defaults: far above a real LAN).

    ``max_learned_targets``: addresses learned from mDNS and peer lists, kept for dialing.
    A home or lab mesh has tens of nodes; a spoofed-advert flood stops here (static
    ``--peer`` addresses never count).
    ``max_concurrent_dials``: dials (TCP connect + TLS + Hello) under way at once.
    ``max_pending_handshakes``: inbound connections still in TLS or before ``Hello``;
    ``max_pending_per_source``: those of them from one address. Beyond either, the
    oldest idle one is closed to make room (:mod:`meshnode.node.handshakes`) and counted in
    ``refused_handshakes``. A few nodes share an address at most (tests run several on
    loopback), and they do not all join in the same second.
    ``client_hello_timeout_s``: how long a new inbound connection may stay silent.
    """

    max_learned_targets: int = 256
    max_concurrent_dials: int = 16
    max_pending_handshakes: int = 32
    max_pending_per_source: int = 8
    client_hello_timeout_s: float = CLIENT_HELLO_TIMEOUT_S


DEFAULT_LIMITS: Final = MeshLimits()

# One refusal line per kind per this many seconds; the next line says how many were held back.
REFUSAL_LOG_INTERVAL_S: Final = 10.0
#: Lines one peer may cause at once, then per second (:class:`TokenBuckets`): a failing run
#: logs a few errors per failed request; a member's flood of Error frames (30 MB of log in
#: 2 s, issue 36 item 9) is cut to a trickle of about 2 KiB/s.
PEER_LOG_BURST: Final = 20
PEER_LOG_PER_S: Final = 5.0
#: Keys whose buckets are remembered; past this the longest-idle one is forgotten (a member
#: can mint identities, a spoofer can advertise any address, so the table is bounded too).
MAX_TRACKED_KEYS: Final = 1024
#: New dial targets one advertised host may add at once, then per second: a host runs a
#: node or a few (several per host on loopback in tests); a spoofer's 2,000 adverts from
#: one host add a handful (issue 36, item 3).
HOST_TARGETS_BURST: Final = 8
HOST_TARGETS_PER_S: Final = 1.0


@dataclass
class RateLimitedLog:
    """Logs at most one warning per ``key`` per ``interval_s`` (times from the caller's clock).

    Suppressed warnings are counted and the count is appended to the next one logged, so the
    log still says how often it happened.
    """

    logger: logging.Logger
    interval_s: float = REFUSAL_LOG_INTERVAL_S
    _next_s: dict[str, float] = field(default_factory=dict)
    _held: dict[str, int] = field(default_factory=dict)

    def warning(self, key: str, now_s: float, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval_s`` ago.

        Returns whether it was logged.
        """
        if now_s < self._next_s.get(key, float("-inf")):
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        suffix = f" ({held} more like this in the last {self.interval_s:g} s)" if held else ""
        self.logger.warning(msg + suffix, *args)
        self._next_s[key] = now_s + self.interval_s
        return True


@dataclass
class _Bucket:
    tokens: float
    at: float
    refused: int = 0


@dataclass
class TokenBuckets:
    """A token bucket per key (a peer's lines in the log, a host's new dial targets):
    ``burst`` at once, then ``per_s`` a second; refused ones are counted and the count is
    handed back with the key's next allowed one. Times are from the caller's clock."""

    burst: int = PEER_LOG_BURST
    per_s: float = PEER_LOG_PER_S
    max_keys: int = MAX_TRACKED_KEYS
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def allow(self, key: str, now: float) -> int | None:
        """None when ``key`` may not have one more at ``now``; else the count of those it
        was refused since its last allowed one (0 when none was)."""
        bucket = self._buckets.pop(key, None) or _Bucket(float(self.burst), now)
        self._buckets[key] = bucket  # last in the dict: the most recently seen
        if len(self._buckets) > self.max_keys:
            del self._buckets[next(iter(self._buckets))]
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.per_s)
        bucket.at = now
        if bucket.tokens < 1.0:
            bucket.refused += 1
            return None
        bucket.tokens -= 1.0
        refused, bucket.refused = bucket.refused, 0
        return refused
