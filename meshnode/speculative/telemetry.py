"""Speculation counters for one response, one model or the whole node.

``SpecStats`` is a plain accumulator: the driver records every step, ``merge`` adds two of
them (per-request stats into the node's), and ``as_dict`` gives the JSON object that the
API puts in its extension field and ``/metrics`` exposes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class SpecStats:
    """Counts and times of verify passes (``windows``) and plain decode steps.

    A verify pass with ``k`` drafts of which ``a`` were accepted commits ``a + 1`` tokens.
    """

    windows: int = 0
    proposed: int = 0
    accepted: int = 0
    verify_seconds: float = 0.0
    plain_steps: int = 0
    plain_seconds: float = 0.0

    def record(self, proposed: int, accepted: int, seconds: float = 0.0) -> None:
        """Count one step; ``proposed == 0`` is a plain decode step."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} outside 0..{proposed}")
        if proposed == 0:
            self.plain_steps += 1
            self.plain_seconds += seconds
            return
        self.windows += 1
        self.proposed += proposed
        self.accepted += accepted
        self.verify_seconds += seconds

    def merge(self, other: SpecStats) -> SpecStats:
        """A new accumulator holding the sums of both."""
        return SpecStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    @property
    def accept_rate(self) -> float | None:
        """Accepted drafts over proposed drafts."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_verify(self) -> float | None:
        """Tokens committed per verify pass (accepted drafts + the target's own token)."""
        return (self.accepted + self.windows) / self.windows if self.windows else None

    @property
    def cost_per_accepted_token(self) -> float | None:
        """Verify seconds per token committed by verify passes.

        Compare with ``plain_step_seconds``: speculation pays while this is smaller.
        """
        committed = self.accepted + self.windows
        return self.verify_seconds / committed if committed and self.verify_seconds else None

    @property
    def plain_step_seconds(self) -> float | None:
        """Mean wall time of a plain decode step."""
        return self.plain_seconds / self.plain_steps if self.plain_steps else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready counters and derived rates (``None`` where undefined)."""
        return {
            "windows": self.windows,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "accept_rate": self.accept_rate,
            "tokens_per_verify": self.tokens_per_verify,
            "verify_seconds": self.verify_seconds,
            "cost_per_accepted_token_s": self.cost_per_accepted_token,
            "plain_steps": self.plain_steps,
            "plain_seconds": self.plain_seconds,
            "plain_step_s": self.plain_step_seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecStats:
        """Inverse of ``as_dict`` (derived rates are recomputed, not read)."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def summarize(stats: list[SpecStats]) -> SpecStats:
    """The sum of many accumulators (an empty list gives zeros)."""
    total = SpecStats()
    for item in stats:
        total = total.merge(item)
    return total
