"""The pre-Hello table's decision (``meshnode.node.handshakes``), as a table: which entry
makes room for a newcomer."""

from __future__ import annotations

import pytest
import trio

from meshnode.net.limits import MeshLimits
from meshnode.node.handshakes import Pending, PendingHandshakes

LIMITS = MeshLimits(max_pending_handshakes=3, max_pending_per_source=2)


def _entry(source: str, since_s: float, *, spoke: bool) -> Pending:
    return Pending(source, since_s, trio.CancelScope(), spoke=spoke)


@pytest.mark.parametrize(
    ("held", "newcomer", "evicted"),
    [
        # Room left: nobody goes.
        ([("a", 0, True)], "b", []),
        # Full: the oldest silent one goes, even if a speaking one is older.
        ([("a", 0, True), ("b", 1, False), ("c", 2, False)], "d", [1]),
        # Full of speaking ones: the oldest goes.
        ([("a", 0, True), ("b", 1, True), ("c", 2, True)], "d", [0]),
        # A source at its bound gives up its own oldest silent one, not another's.
        ([("a", 0, False), ("b", 1, True), ("b", 2, False)], "b", [2]),
        # A source at its bound and a full table: its own first, then the table has room.
        ([("x", 0, False), ("b", 1, True), ("b", 2, True)], "b", [1]),
    ],
)
def test_which_pending_handshake_makes_room(
    held: list[tuple[str, float, bool]], newcomer: str, evicted: list[int]
) -> None:
    table = PendingHandshakes(LIMITS)
    entries = [_entry(source, since, spoke=spoke) for source, since, spoke in held]
    for i, entry in enumerate(entries):
        assert table.add(i, entry) == []
    gone = table.add("new", _entry(newcomer, 10.0, spoke=False))
    assert gone == [entries[i] for i in evicted]
    assert len(table) == len(held) - len(evicted) + 1
    assert len(table) <= LIMITS.max_pending_handshakes
    assert table.from_source(newcomer) <= LIMITS.max_pending_per_source
