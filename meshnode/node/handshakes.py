"""Inbound connections before their ``Hello``: a bounded table that strangers cannot fill.

Anyone can open TCP connections to the mesh port, and each holds a slot until its TLS
handshake and ``Hello`` are done. Before (issue 36, item 1), 32 idle connections, re-opened
as the node dropped each after its 5 s handshake timeout, kept every slot busy: members
could not join while it lasted. The table now decides, as a pure function of what it holds:

- at most ``max_pending_per_source`` connections from one address, and
  ``max_pending_handshakes`` in all;
- a new connection is always taken: when a bound is reached, the one that makes room is
  the oldest that has not yet sent a byte (its TLS ClientHello), else the oldest of all;
  so idle connections are evicted before any handshake under way;
- the caller gives a new connection only ``client_hello_timeout_s`` to send its first
  bytes (a dialer sends its ClientHello as soon as TCP connects).

Evicted entries are handed back to the caller, which cancels their scopes and counts them
as refused.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import trio

from meshnode.net.limits import MeshLimits

__all__ = ["Pending", "PendingHandshakes"]


@dataclass(eq=False)
class Pending:
    """One connection before its ``Hello``; cancel ``scope`` to drop it."""

    source: str
    since_s: float
    scope: trio.CancelScope
    spoke: bool = False  # its first bytes (the TLS ClientHello) arrived


def _victim(entries: list[Pending]) -> Pending:
    """The entry that makes room: the oldest silent one, else the oldest."""
    return min(entries, key=lambda e: (e.spoke, e.since_s))


class PendingHandshakes:
    """The table of the module docstring, keyed by the caller's connection object."""

    def __init__(self, limits: MeshLimits) -> None:
        self.limits = limits
        self._entries: dict[Hashable, Pending] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def from_source(self, source: str) -> int:
        """How many pending connections came from ``source``."""
        return sum(e.source == source for e in self._entries.values())

    def add(self, key: Hashable, entry: Pending) -> list[Pending]:
        """Take ``entry``; the entries evicted to make room (already out of the table)."""
        evicted: list[Pending] = []
        same = [e for e in self._entries.values() if e.source == entry.source]
        if len(same) >= self.limits.max_pending_per_source:
            evicted.append(self._remove(_victim(same)))
        if len(self._entries) >= self.limits.max_pending_handshakes:
            evicted.append(self._remove(_victim(list(self._entries.values()))))
        self._entries[key] = entry
        return evicted

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` (past its Hello, or gone); nothing if it is not held."""
        self._entries.pop(key, None)

    def _remove(self, entry: Pending) -> Pending:
        key = next(k for k, e in self._entries.items() if e is entry)
        del self._entries[key]
        return entry
