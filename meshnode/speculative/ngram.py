"""N-gram (prompt lookup) proposer: copy what followed the last occurrence of the suffix.

Code edits, quoted passages and structured text repeat the request's own tokens. The
proposer finds the longest suffix of the history (between ``min_n`` and ``max_n`` tokens)
that occurred before, and proposes the tokens that followed that earlier occurrence.

The index maps every n-gram to the position right after its most recent occurrence and is
updated incrementally as tokens are committed (O(max_n) dict operations per token), so a
lookup never rescans the history. An n-gram is inserted only once the token after it is
known, so the current suffix never matches itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.speculative.proposer import EMPTY_PROPOSAL, Proposal


@dataclass(frozen=True, slots=True)
class NgramParams:
    """Lookup sizes: match suffixes of ``min_n..max_n`` tokens, propose ``max_proposal``."""

    min_n: int = 2
    max_n: int = 4
    max_proposal: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_proposal < 1:
            raise ValueError(f"max_proposal must be >= 1, got {self.max_proposal}")


class NgramIndex:
    """Incremental n-gram → next-position index over one growing token sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        # Number of insertions whose n-gram (of length min_n) was already present: how
        # much the sequence repeats itself. The auto mode reads it to judge prompt shape.
        self.repeats = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index the n-grams they complete."""
        for token in tokens:
            self._index_before(len(self.tokens))
            self.tokens.append(token)

    def _index_before(self, pos: int) -> None:
        # The n-grams ending at pos - 1 are now followed by a known token (at pos).
        for n in range(self.min_n, min(self.max_n, pos) + 1):
            key = tuple(self.tokens[pos - n : pos])
            if n == self.min_n and key in self._last:
                self.repeats += 1
            self._last[key] = pos

    def match(self) -> tuple[int, int] | None:
        """``(n, continuation position)`` for the longest suffix seen before, or ``None``."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            pos = self._last.get(tuple(self.tokens[end - n :]))
            if pos is not None:
                return n, pos
        return None

    def continuation(self, pos: int, count: int) -> list[int]:
        """``count`` tokens copied from ``pos`` on, LZ77-style.

        The copy may run past the end of the history into the tokens it is producing, so
        a period-p repetition (``a b a b …``) is continued for the whole window.
        """
        out: list[int] = []
        tokens = self.tokens
        end = len(tokens)
        for i in range(count):
            src = pos + i
            out.append(tokens[src] if src < end else out[src - end])
        return out


class NgramProposer:
    """Proposes by longest-suffix lookup over the request's prompt and committed tokens."""

    def __init__(self, params: NgramParams | None = None) -> None:
        self.params = params or NgramParams()
        self.index = NgramIndex(self.params.min_n, self.params.max_n)

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index up to ``history``; rebuild if it is not an extension.

        Only the length and the last indexed token are compared (O(1)): a caller that
        replaced the history with one of the same length and last token would get stale
        guesses, which costs acceptance, never correctness.
        """
        indexed = len(self.index)
        if indexed > len(history) or (indexed and history[indexed - 1] != self.index.tokens[-1]):
            self.index = NgramIndex(self.params.min_n, self.params.max_n)
            indexed = 0
        self.index.extend(history[indexed:])

    def lookup(self, history: Sequence[int], max_tokens: int) -> list[int]:
        """The would-be proposal for ``history`` (empty when no suffix matches)."""
        self.sync(history)
        count = min(max_tokens, self.params.max_proposal)
        found = self.index.match() if count > 0 else None
        if found is None:
            return []
        return self.index.continuation(found[1], count)

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        """Up to ``max_tokens`` tokens that followed the longest earlier suffix match."""
        tokens = self.lookup(history, max_tokens)
        return Proposal(tuple(tokens)) if tokens else EMPTY_PROPOSAL

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        """Plain n-gram lookup keeps no feedback state."""
