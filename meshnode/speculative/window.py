"""Window policy: how many drafts to verify in the next pass.

A fixed policy always asks for ``initial_window`` drafts. An adaptive one starts there and
then picks, within ``[min_window, max_window]``, the window that commits the most tokens per
second of step time:

    window = argmax over k of  expected_tokens(k, rate) / cost(k)

``rate`` is the request's per-draft acceptance rate, decayed so the last few drafts count
most; ``expected_tokens(k, rate) = 1 + rate + … + rate^k`` is what a k-draft pass commits when
each draft survives with probability ``rate`` (Leviathan et al. 2023, §3.3). ``cost(k)`` is
the measured wall time of a step with k drafts (proposing included), kept in
:class:`StepCosts`, which the requests of one node share: what a pass costs is a property of
the mesh, not of the request.

Why not the halve-on-rejection rule TCP uses: a rejected draft costs little here. Verify
cost is far from linear in k (on a CPU an 8-row forward costs about as much as a 4-row one,
on a GPU or across a network the pass costs nearly the same for any small k), so the right
window depends on the cost curve, which is measured, not assumed. The rule still moves the
way one expects: full acceptance raises ``rate`` and never shrinks the window, a rejection
lowers it and never grows the window (for a fixed cost table, the argmax is monotone in
``rate``).

A size not measured yet is interpolated between measured ones, and past the largest measured
size costs are assumed flat: the policy tries a larger window when the acceptance rate says
it could pay, measures it, and keeps it only if it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

WindowKind = Literal["fixed", "adaptive"]

# Weight of the past in the acceptance estimate, per draft verified: about the last seven
# drafts count. Copying output (code edits) runs in stretches, so old drafts mislead, and
# a rejection must weigh against a long accepted window's recent drafts, not all of them.
RATE_DECAY = 0.85
# Prior pseudo-counts: a fresh request starts at rate 0.5, as if one of two drafts matched,
# and one window moves it substantially.
PRIOR_ACCEPTED = 1.0
PRIOR_TRIED = 2.0
# Weight of the newest sample in a step-cost average.
COST_ALPHA = 0.25
# Steps (of any size, on the node) after which a size's measured cost counts as unknown.
# A few hundred milliseconds to seconds of decoding: re-measuring a size costs one pass.
STALE_AFTER_STEPS = 32


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    """Fixed or adaptive window; all sizes count draft tokens (the verify pass is k + 1)."""

    kind: WindowKind = "adaptive"
    initial_window: int = 4
    min_window: int = 1
    max_window: int = 16

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise ValueError(f"window policy must be fixed or adaptive, got {self.kind!r}")
        if not 1 <= self.min_window <= self.initial_window <= self.max_window:
            raise ValueError(
                "need 1 <= min_window <= initial_window <= max_window, got "
                f"{self.min_window}, {self.initial_window}, {self.max_window}"
            )


def expected_tokens(drafts: int, rate: float) -> float:
    """Tokens one pass with ``drafts`` drafts commits: ``1 + rate + … + rate^drafts``."""
    return sum(rate**i for i in range(drafts + 1))


@dataclass(slots=True)
class StepCosts:
    """Seconds of a step by its number of drafts, exponentially averaged.

    Shared by the requests of one node (and reset when its pipeline changes): the cost of a
    k-draft pass depends on the machines and the mesh, which every request sees alike. A
    size not measured in the last ``STALE_AFTER_STEPS`` steps is treated as unmeasured, so
    one slow step (another process took the core) cannot rule a size out for good: the
    policy re-measures it when its estimate from fresher sizes says it may pay.
    """

    seconds: dict[int, float] = field(default_factory=dict)
    measured_at: dict[int, int] = field(default_factory=dict)
    steps: int = 0

    def record(self, drafts: int, seconds: float) -> None:
        """Add one measured step of ``drafts`` drafts."""
        self.steps += 1
        old = self.seconds.get(drafts) if self._fresh(drafts) else None
        self.seconds[drafts] = seconds if old is None else old + COST_ALPHA * (seconds - old)
        self.measured_at[drafts] = self.steps

    def _fresh(self, drafts: int) -> bool:
        at = self.measured_at.get(drafts)
        return at is not None and self.steps - at <= STALE_AFTER_STEPS

    def fresh(self) -> dict[int, float]:
        """The costs measured in the last ``STALE_AFTER_STEPS`` steps, by draft count."""
        return {k: v for k, v in self.seconds.items() if self._fresh(k)}

    def estimate(self, drafts: int) -> float | None:
        """Cost of a ``drafts``-draft step; ``None`` before anything was measured.

        A size not measured yet is interpolated linearly between its measured neighbours
        (plain steps count as size 0). Past the largest measured size costs are assumed
        flat, below the smallest one proportional to the rows (``drafts + 1``): both are
        optimistic guesses, which make the policy try such a size once and measure it.
        """
        return _estimate(self.fresh(), drafts)


def _estimate(fresh: dict[int, float], drafts: int) -> float | None:
    if drafts in fresh:
        return fresh[drafts]
    if not fresh:
        return None
    below = [k for k in fresh if k < drafts]
    above = [k for k in fresh if k > drafts]
    if below and above:
        lo, hi = max(below), min(above)
        share = (drafts - lo) / (hi - lo)
        return fresh[lo] + share * (fresh[hi] - fresh[lo])
    if below:
        return fresh[max(below)]
    hi = min(above)
    return fresh[hi] * (drafts + 1) / (hi + 1)


class Window:
    """One request's window: its size now, updated after every step."""

    def __init__(self, policy: WindowPolicy, costs: StepCosts | None = None) -> None:
        self.policy = policy
        self.costs = costs if costs is not None else StepCosts()
        self.size = policy.initial_window
        self._passes = 0
        self._accepted = PRIOR_ACCEPTED
        self._tried = PRIOR_TRIED

    @property
    def accept_rate(self) -> float:
        """Decayed per-draft acceptance estimate."""
        return self._accepted / self._tried

    def update(self, proposed: int, accepted: int, seconds: float | None = None) -> None:
        """Account for a step that verified ``proposed`` drafts and kept ``accepted``.

        ``seconds`` is the step's wall time (proposing and verifying). A plain step
        (``proposed == 0``) only adds its cost, as size 0. The request's
        first pass is not counted as a cost: it also pays one-time work (a draft model
        catching up over the whole prompt), which would make its size look dear for good.
        """
        if proposed == 0:
            if seconds is not None:
                self.costs.record(0, seconds)
            return
        self._passes += 1
        if seconds is not None and self._passes > 1:
            self.costs.record(proposed, seconds)
        if self.policy.kind == "fixed":
            return
        # A pass tries drafts in order until the first rejection: accepted successes, then
        # one failure unless every draft survived.
        outcomes = [1.0] * accepted + ([0.0] if accepted < proposed else [])
        for outcome in outcomes:
            self._accepted = RATE_DECAY * self._accepted + outcome
            self._tried = RATE_DECAY * self._tried + 1.0
        self.size = best_window(self.policy, self.costs, self.accept_rate, self.size)


def best_window(policy: WindowPolicy, costs: StepCosts, rate: float, current: int) -> int:
    """The window in ``[min_window, max_window]`` with the most tokens per second.

    With no cost measured yet there is nothing to weigh: ``current`` stays. Ties go to the
    smaller window.
    """
    if not costs.seconds:
        return current
    fresh = costs.fresh()  # once per step, not once per candidate size
    sizes = range(policy.min_window, policy.max_window + 1)
    # A clock that stands still measures 0.
    values = [expected_tokens(k, rate) / (_estimate(fresh, k) or 1.0) for k in sizes]
    # The smallest size within rounding of the best: comparing each size with the best so
    # far instead would let rounding pick a larger window for a lower rate.
    floor = max(values) * (1 - 1e-9)
    return next(k for k, value in zip(sizes, values, strict=True) if value >= floor)
