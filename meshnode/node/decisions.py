"""The coordinator's decisions, pure: ``next_action(state, event) -> (state, action)``.

The coordinator's loop (:mod:`meshnode.node.coordinator`) does the I/O — planning against
the live nodes, bringing runs up, serving, probing — and hands what happened to
:func:`next_action` as an event. The :class:`CoordinatorState` it gets back says which nodes
the next plan leaves out and why the mesh is not (or was not) serving, as typed
:class:`Failure` records; the action says what to do now (back off, replan after a loss).
It reads no clock: events carry the trio time (``now``).

Nodes are left out of plans for four reasons, each ending its own way:

- **excluded**: a node that failed a bring-up (did not prepare, answer or load), or that a
  pipeline named as lost; until the membership changes.
- **cooling off**: a node blamed for a lost pass while alive to the membership; for
  ``BLAME_COOL_OFF_S`` whatever the membership does (module ``coordinator``, Blame).
- **refused**: a node that refused the Claim because another host holds it. Being freed
  changes nothing in the membership, so it is tried again after ``CLAIM_RETRY_FIRST_S``,
  doubling with each refusal in a row up to ``CLAIM_RETRY_MAX_S`` (issue 36 item 7: the
  plan grows back once it is free).
- the host's own stage 0 is never left out.

**Blame from what the host observes** (issue 36 item 5). A pass that misses its deadline
without naming its node leaves the host one fact it saw itself: the last stage's reply is
missing, so the pass was lost in one of the remote stages it crossed. The probe's answers
come from the stages and only add to that: a stage that does not answer, or no longer
holds the run, is blamed first; then the one whose pass in progress is the oldest, if
long. When every stage answers idle, the stage's word is not taken for it: each remote
stage of the run is a suspect of this *untraced* loss, and a node suspect of
``UNTRACED_LOSSES_TO_BLAME`` untraced losses within ``BLAME_COOL_OFF_S`` is blamed (the
one suspect most often, first in pipeline order on a tie). One pass lost on a passing
glitch blames nobody; a stage that drops every pass while answering probes as idle is
blamed on the second and cooled off, so the host stops re-placing onto it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

# A failed bring-up is retried after RETRY_BACKOFF_FIRST_S, doubling with each failure in
# a row up to RETRY_BACKOFF_MAX_S. A stage that keeps failing (a damaged file, a device
# that refuses) replanned at once, 46 times in 12 s, flooding the log and the workers;
# a passing glitch (a node that restarted) still costs under a second.
RETRY_BACKOFF_FIRST_S = 0.5
RETRY_BACKOFF_MAX_S = 30.0
# How long a node blamed for a lost pass stays out of the plans (module docstring, Blame).
# Five minutes: a node that hangs on every pass then costs one replay per five minutes,
# while one that hung once (a stalled disk, a swapped-out process) is used again soon.
BLAME_COOL_OFF_S = 300.0
# Untraced losses (every stage answered the probe as idle) a node must be a suspect of,
# within BLAME_COOL_OFF_S, to be blamed. Two: one lost pass may be a glitch of the network
# and costs one replay; a request survives three replays (generation.replay.MAX_REPLAYS), so
# a node that drops every pass is out of the plan before the request that found it fails.
UNTRACED_LOSSES_TO_BLAME = 2
# A node that refused the Claim (another host holds it) is claimed again after this,
# doubling with each refusal in a row up to CLAIM_RETRY_MAX_S. Trying costs a re-placement
# between requests (the API answers 503 meanwhile) when the node is still taken, so the
# wait grows; five minutes at most, as long as a blamed node sits out.
CLAIM_RETRY_FIRST_S = 15.0
CLAIM_RETRY_MAX_S = 300.0


def retry_delay(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed bring-up in a row (0 for none)."""
    if failures < 1:
        return 0.0
    return float(min(RETRY_BACKOFF_FIRST_S * 2.0 ** (failures - 1), RETRY_BACKOFF_MAX_S))


def claim_retry_delay(refusals: int) -> float:
    """Seconds before a node is claimed again after its ``refusals``-th refusal in a row."""
    return float(min(CLAIM_RETRY_FIRST_S * 2.0 ** (max(refusals, 1) - 1), CLAIM_RETRY_MAX_S))


class FailureKind(enum.StrEnum):
    """What went wrong, for the status and for the decisions that follow."""

    NO_FIT = "no-fit"  # the planner placed nothing: too few nodes, too little memory
    BRING_UP = "bring-up"  # a step of the bring-up failed (Claim, Prepare, Load, Ready)
    STAGE_LEFT = "stage-left"  # a stage's node said goodbye
    STAGE_LOST = "stage-lost"  # a stage's node was lost, or its pipeline named it
    BLAMED = "blamed"  # a pass was lost and a stage was blamed for it
    UNTRACED = "untraced"  # a pass was lost and no stage is blamed (yet)
    STAGE0_HUNG = "stage0-hung"  # this node's own stage-0 computes hang
    REGROW = "regrow"  # not a failure: the plan grows back to the nodes that returned


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure of the mesh: its kind, the node it is laid on (if any) and the reason,
    which is what the status and the logs show (``str(failure)``)."""

    kind: FailureKind
    reason: str
    node: str | None = None

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True, slots=True)
class Refusal:
    """A node that refused the Claim: when to claim it again, and refusals in a row."""

    retry_at: float
    count: int


@dataclass(frozen=True, slots=True)
class CoordinatorState:
    """What the coordinator remembers between runs (module docstring)."""

    excluded: frozenset[str] = frozenset()
    cooling: Mapping[str, float] = field(default_factory=dict)  # node -> its cool-off's end
    refused: Mapping[str, Refusal] = field(default_factory=dict)
    untraced: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # node -> times
    failures: int = 0  # bring-ups failed in a row (the retry backs off)
    recovering: bool = False  # the plan was made after a loss: it may grow back
    first_plan: bool = True  # --split binds the first plan; later ones serve on what is left
    error: Failure | None = None  # why the mesh is not serving now
    last_failure: Failure | None = None  # kept after recovery: why the plan is not the first

    def kept_out(self, now: float) -> frozenset[str]:
        """The nodes the next plan leaves out at trio time ``now``."""
        cooling = {n for n, t in self.cooling.items() if t > now}
        refused = {n for n, r in self.refused.items() if r.retry_at > now}
        return self.excluded | cooling | refused

    def wake_at(self, now: float) -> float | None:
        """The trio time a node left out comes back by itself (a cool-off ends, a refused
        node is due for another Claim), or None: only a membership change frees one."""
        times = [t for t in self.cooling.values() if t > now]
        times += [r.retry_at for r in self.refused.values() if r.retry_at > now]
        return min(times, default=None)

    def cooling_off(self, now: float) -> dict[str, float]:
        """Seconds each node still cools off, by node id (the status's ``cooling_off``)."""
        return {node: round(t - now, 1) for node, t in sorted(self.cooling.items()) if t > now}


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    """A plan was made."""


@dataclass(frozen=True, slots=True)
class NoFit:
    """The planner placed nothing (``reason``: the planner's)."""

    reason: str


@dataclass(frozen=True, slots=True)
class MembershipChanged:
    """A node joined, was lost or left: give the excluded nodes another go."""


@dataclass(frozen=True, slots=True)
class BringUpFailed:
    """A bring-up failed with ``reason``; ``failed`` nodes did not do their part,
    ``refused`` nodes refused the Claim (another host holds them)."""

    reason: str
    now: float
    failed: frozenset[str] = frozenset()
    refused: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class BackedOff:
    """The back-off after a failed bring-up is over: the next plan's trouble is its own."""


@dataclass(frozen=True, slots=True)
class Serving:
    """A run of ``nodes`` is up and serving: their claims were accepted."""

    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StageFailed:
    """The pipeline failed naming ``node`` (``left``: a goodbye), or the membership lost
    one of its stages; ``exclude``: keep ``node`` out until the membership changes."""

    node: str | None
    reason: str
    left: bool = False
    exclude: bool = False


@dataclass(frozen=True, slots=True)
class Probed:
    """A pass was lost without naming its node (``reason``); the probe's ``answers`` by
    remote stage, in pipeline order ``stages`` (the age of each one's pass in progress in
    ms, None: silent or runless); ``min_busy_ms``: how old a pass must be to blame."""

    reason: str
    stages: tuple[str, ...]
    answers: Mapping[str, int | None]
    min_busy_ms: int
    now: float


@dataclass(frozen=True, slots=True)
class Replaced:
    """The pipeline ended (``loss``; None: the plan grows back) and the mesh replans."""

    loss: Failure | None


@dataclass(frozen=True, slots=True)
class Stage0Hung:
    """``count`` stage-0 computes of earlier runs have not come back (0: none now)."""

    count: int


Event = (
    Planned
    | NoFit
    | MembershipChanged
    | BringUpFailed
    | BackedOff
    | Serving
    | StageFailed
    | Probed
    | Replaced
    | Stage0Hung
)


# -- actions --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackOff:
    """Wait ``delay_s`` before the next plan."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class Replan:
    """The pipeline is lost with ``loss``: fail it, stop its stages and plan again."""

    loss: Failure


Action = BackOff | Replan | None


def next_action(state: CoordinatorState, event: Event) -> tuple[CoordinatorState, Action]:
    """The state after ``event`` and what the coordinator does next (None: go on)."""
    if isinstance(event, Planned):
        return replace(state, first_plan=False), None
    if isinstance(event, NoFit):
        return replace(state, error=Failure(FailureKind.NO_FIT, event.reason)), None
    if isinstance(event, MembershipChanged):
        return replace(state, excluded=frozenset()), None
    if isinstance(event, BringUpFailed):
        return _bring_up_failed(state, event)
    if isinstance(event, BackedOff):
        return replace(state, error=None), None
    if isinstance(event, Serving):
        refused = {n: r for n, r in state.refused.items() if n not in event.nodes}
        return replace(state, failures=0, error=None, refused=refused), None
    if isinstance(event, StageFailed):
        return _stage_failed(state, event)
    if isinstance(event, Probed):
        return _probed(state, event)
    if isinstance(event, Replaced):
        if event.loss is None:
            return replace(state, recovering=False), None
        return replace(state, recovering=True, last_failure=event.loss), None
    if isinstance(event, Stage0Hung):
        if event.count == 0:
            return replace(state, error=None), None
        reason = (
            f"stage 0 on this node hangs: {event.count} of its passes have not come "
            "back; no new run until one does (restart meshnode if none does)"
        )
        return replace(state, error=Failure(FailureKind.STAGE0_HUNG, reason)), None
    raise TypeError(f"coordinator: unknown event {type(event).__name__}")


def _bring_up_failed(
    state: CoordinatorState, event: BringUpFailed
) -> tuple[CoordinatorState, Action]:
    failure = Failure(FailureKind.BRING_UP, event.reason, _only(event.failed | event.refused))
    refused = dict(state.refused)
    for node in event.refused:
        count = refused[node].count + 1 if node in refused else 1
        refused[node] = Refusal(event.now + claim_retry_delay(count), count)
    failures = state.failures + 1
    state = replace(
        state,
        excluded=state.excluded | (event.failed - event.refused),
        refused=refused,
        failures=failures,
        recovering=True,
        error=failure,
        last_failure=failure,
    )
    return state, BackOff(retry_delay(failures))


def _stage_failed(state: CoordinatorState, event: StageFailed) -> tuple[CoordinatorState, Action]:
    kind = FailureKind.STAGE_LEFT if event.left else FailureKind.STAGE_LOST
    excluded = state.excluded
    if event.exclude and event.node is not None:
        excluded = excluded | {event.node}
    return replace(state, excluded=excluded), Replan(Failure(kind, event.reason, event.node))


def _probed(state: CoordinatorState, event: Probed) -> tuple[CoordinatorState, Action]:
    """Blame (module docstring): the probe's evidence first, then the untraced losses."""
    node = blame(event.stages, event.answers, min_busy_ms=event.min_busy_ms)
    untraced = {
        n: tuple(t for t in times if t > event.now - BLAME_COOL_OFF_S)
        for n, times in state.untraced.items()
    }
    if node is None:
        for stage in event.stages:
            untraced[stage] = (*untraced.get(stage, ()), event.now)
        node = _most_suspect(event.stages, untraced)
    untraced = {n: times for n, times in untraced.items() if times and n != node}
    if node is None:
        loss = Failure(FailureKind.UNTRACED, f"{event.reason} (no stage to blame)")
        return replace(state, untraced=untraced), Replan(loss)
    cooling = {**state.cooling, node: event.now + BLAME_COOL_OFF_S}
    loss = Failure(FailureKind.BLAMED, f"{event.reason}: blamed on stage node {node}", node)
    return replace(state, cooling=cooling, untraced=untraced), Replan(loss)


def _most_suspect(stages: Sequence[str], untraced: Mapping[str, tuple[float, ...]]) -> str | None:
    """The stage suspect of the most untraced losses, if of enough (first on a tie)."""
    best = max(stages, key=lambda s: len(untraced.get(s, ())), default=None)
    if best is None or len(untraced.get(best, ())) < UNTRACED_LOSSES_TO_BLAME:
        return None
    return best


def blame(
    stages: Sequence[str], answers: Mapping[str, int | None], *, min_busy_ms: int
) -> str | None:
    """The stage the probe's answers blame for a pass that did not come back.

    ``stages`` are the run's remote stages in pipeline order; ``answers`` what each said to
    the probe (the age of its pass in progress in ms, ``None``: silent or refusing). The
    first silent stage, else the one with the oldest pass in progress if at least
    ``min_busy_ms`` old, else None (then the untraced losses decide: module docstring).
    """
    for node in stages:
        if answers.get(node) is None:
            return node
    busy = [(answers[node] or 0, node) for node in stages]
    oldest_ms, node = max(busy, default=(0, ""))
    return node if oldest_ms >= min_busy_ms else None


def _only(nodes: frozenset[str]) -> str | None:
    return next(iter(nodes)) if len(nodes) == 1 else None
