"""The proposer side of speculation: what a proposer returns and what it is told back.

A proposer guesses the next tokens of one sequence. The driver verifies the guess with one
target forward of ``k + 1`` rows and reports how many drafts were accepted. A proposal of
zero tokens means "do not speculate this step": the driver runs a plain decode step and
still reports it (``proposed=0``), so that proposers with a cost model see plain step times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Proposal:
    """Draft tokens for one sequence.

    ``probs`` holds the draft distribution each token was drawn from, one row per token
    (``[k, vocab]``); ``None`` means the proposal is deterministic (a one-hot ``q``, as
    for n-gram lookups and greedy drafts).
    """

    tokens: tuple[int, ...]
    probs: FloatArray | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(
                f"draft probs have {self.probs.shape[0]} rows for {len(self.tokens)} tokens"
            )

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_PROPOSAL = Proposal(())


class Proposer(Protocol):
    """Guesses continuations of one sequence (one proposer instance per request)."""

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        """Up to ``max_tokens`` drafts following ``history`` (prompt + committed tokens).

        ``history`` only grows between calls of one request, except that tokens the
        target rejected were never part of it. Returning an empty proposal skips
        speculation for this step.
        """
        ...

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        """Feedback after the step: drafts sent, drafts accepted, and the step's wall time.

        ``proposed == 0`` reports a plain decode step.
        """
        ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest shared prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
