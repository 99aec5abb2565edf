"""Window policy: how many drafts to verify in the next pass.

A fixed policy always asks for ``initial_window`` drafts. An adaptive one starts there and
moves within ``[min_window, max_window]``: additive increase after a fully accepted window
(the verifier could have taken more), multiplicative decrease after an early rejection
(most of the pass was wasted). The update is a pure function of the policy, the current
window and the step's outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WindowKind = Literal["fixed", "adaptive"]

# Growth per fully accepted window. Additive so that one lucky run does not jump to the
# maximum: each extra draft must earn its place.
GROW_STEP = 1
# A rejection within the first half of the proposal counts as "early": more than half the
# verify rows were dead. The window is then halved (AIMD, as TCP does with its window).
EARLY_REJECT_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    """Fixed or adaptive window; all sizes count draft tokens (the verify pass is k + 1)."""

    kind: WindowKind = "adaptive"
    initial_window: int = 4
    min_window: int = 1
    max_window: int = 8

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise ValueError(f"window policy must be fixed or adaptive, got {self.kind!r}")
        if not 1 <= self.min_window <= self.initial_window <= self.max_window:
            raise ValueError(
                "need 1 <= min_window <= initial_window <= max_window, got "
                f"{self.min_window}, {self.initial_window}, {self.max_window}"
            )


def next_window(policy: WindowPolicy, window: int, proposed: int, accepted: int) -> int:
    """The window after a verify pass that accepted ``accepted`` of ``proposed`` drafts.

    Fixed: unchanged. Adaptive: ``+GROW_STEP`` when a full window was proposed and all of
    it accepted; halved when the first rejection came in the first
    ``EARLY_REJECT_FRACTION`` of the proposal; otherwise unchanged. A step with no
    proposal (plain decode) says nothing about the window.
    """
    if policy.kind == "fixed" or proposed == 0:
        return window
    if accepted >= proposed:
        grown = window + GROW_STEP if proposed >= window else window
        return min(policy.max_window, grown)
    if accepted < proposed * EARLY_REJECT_FRACTION:
        return max(policy.min_window, window // 2)
    return window
