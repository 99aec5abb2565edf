"""Stop strings: where the earliest one starts in the text, and how much trailing text
could still become one (held back from the client until the next token decides)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["find_stop", "first_stop", "held_back"]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """The index where the earliest stop string starts in ``text``, or ``None``."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def first_stop(text: str, stops: Sequence[str]) -> str | None:
    """The stop string found earliest in ``text`` (the first listed on a tie), or ``None``."""
    found = [(i, n, s) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    return min(found)[2] if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string.

    Those must not be shown yet: the next token may complete the stop string, and stop
    strings are never part of the reply.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
