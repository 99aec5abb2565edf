"""The MTP proposer: drafts made by the model's own multi-token-prediction module.

The MTP module runs on the last stage (``meshnode.engine.mtp``), where the final hidden
state is; its drafts for the tokens after a pass's committed ones ride back to stage 0 with
the prediction (``StepResult.drafts``, ``Prediction.drafts`` on the wire). The generation
loop hands them to this proposer with :meth:`MtpProposer.offer`; the next window verifies
them. Drafts are greedy, so the proposal is deterministic (one-hot ``q``).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnode.speculative.proposer import EMPTY_PROPOSAL, Proposal

__all__ = ["MtpProposer"]


class MtpProposer:
    """Proposes the drafts the last stage sent after the latest pass (one per request)."""

    def __init__(self) -> None:
        self._drafts: tuple[int, ...] = ()
        self._after = -1  # the history length the drafts follow

    def offer(self, history_len: int, drafts: Sequence[int]) -> None:
        """Drafts for the tokens after the first ``history_len`` tokens of the history."""
        self._drafts, self._after = tuple(drafts), history_len

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        """The offered drafts when they follow ``history`` exactly, else none."""
        if len(history) != self._after or not self._drafts or max_tokens < 1:
            return EMPTY_PROPOSAL
        return Proposal(self._drafts[:max_tokens])

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        """Nothing to learn: the next drafts come with the next prediction."""
