"""Decode speeds the host observes while serving, as the planner's :class:`NodeSpeed`.

Theory of operation. Every pipeline pass comes back with each stage's compute time
(``StepResult.stage_compute_s``: the host times its own stage; the others report theirs in
the prediction). For a pass of one decode row a stage's weight bytes divided by its compute
time is the rate at which that node gets through this model's weights: exactly what the
planner needs (:class:`~meshnode.node.planner.NodeSpeed`), measured on the node's own
backend, threads, formats and load rather than claimed. :class:`SpeedBook` keeps the last
few such rates per node and gives their median, so one slow pass (a page fault, a busy
neighbour) moves nothing; :func:`worth_replacing` says when a plan made from them is far
enough ahead of the serving one to move a run between requests, and
:func:`should_replace` applies it to two plans (the coordinator asks it each time every stage
of the serving pipeline has had :data:`MIN_SAMPLES` more one-row passes: once per pipeline
per measurement change, never mid-request).

A member that lies about its compute time can make the planner give it more or fewer
layers, so it can slow the mesh; it cannot break a run: rates are bounded by
:data:`MAX_BYTES_PER_S`, a plan still has to fit in memory, and the plan it causes is
watched like any other.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence

import trio

from meshnode.node.planner import ModelFootprint, NodeCapacity, NodeSpeed, Plan, plan_seconds

__all__ = [
    "MAX_BYTES_PER_S",
    "MIN_SAMPLES",
    "PassMeter",
    "SpeedBook",
    "should_replace",
    "worth_replacing",
]

#: Passes per node kept; the median of the last 16 one-row passes (a few seconds of decode)
#: follows a node that got slower (throttled, busy) within a request or two.
WINDOW = 16
#: Passes needed before a node counts as measured: fewer leave it to memory weighting.
MIN_SAMPLES = 5
#: No node streams weights faster than this (an H200's HBM is 4.8e12 B/s); a rate above it
#: is a report no machine could make (a lie, or a clock that went backwards), and is dropped.
MAX_BYTES_PER_S = 1e13


class SpeedBook:
    """Per-node decode rates from one-row passes; pure bookkeeping, no I/O."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._rates: dict[str, deque[float]] = {}

    def observe(self, node_id: str, weight_bytes: int, seconds: float, rows: int) -> None:
        """One stage's pass: ``weight_bytes`` read for ``rows`` rows in ``seconds``.

        Only passes of one row count (several rows share one read of the weights, so their
        time is not a per-token rate); impossible values are dropped.
        """
        if rows != 1 or weight_bytes <= 0 or not seconds > 0.0:
            return
        rate = weight_bytes / seconds
        if rate > MAX_BYTES_PER_S:
            return
        self._rates.setdefault(node_id, deque(maxlen=self._window)).append(rate)

    def observe_pass(
        self,
        nodes: Sequence[str],
        weight_bytes: Sequence[int],
        seconds: Sequence[float],
        rows: int,
    ) -> None:
        """A pipeline pass: each stage's node, weight bytes and compute time, in order (a
        pass whose lists disagree in length is dropped)."""
        if len(nodes) == len(weight_bytes) == len(seconds):
            for node, stage_bytes, stage_seconds in zip(nodes, weight_bytes, seconds, strict=True):
                self.observe(node, stage_bytes, stage_seconds, rows)

    def speed(self, node_id: str) -> NodeSpeed | None:
        """The node's median rate, or None while it has fewer than :data:`MIN_SAMPLES`."""
        rates = self._rates.get(node_id)
        if rates is None or len(rates) < MIN_SAMPLES:
            return None
        return NodeSpeed(statistics.median(rates))

    def speeds(self) -> Mapping[str, NodeSpeed]:
        """Every measured node's speed."""
        return {n: s for n in sorted(self._rates) if (s := self.speed(n)) is not None}

    def forget(self, node_id: str) -> None:
        """Drop a node's rates (it left; when it comes back it is measured afresh)."""
        self._rates.pop(node_id, None)


class PassMeter:
    """One pipeline's passes into the speed book: each stage's compute time of a pass, by
    its node and weight bytes; counts the one-row passes that timed every stage, for the
    coordinator's watch (:func:`should_replace` is weighed each ``MIN_SAMPLES`` of them)."""

    def __init__(
        self, book: SpeedBook | None, nodes: Sequence[str], weight_bytes: Sequence[int]
    ) -> None:
        self._book, self._nodes, self._weight_bytes = book, tuple(nodes), tuple(weight_bytes)
        self.created = trio.current_time()  # when the pipeline was brought up
        self.passes = 0  # one-row passes so far that timed every stage
        self.weighed = 0  # ``passes`` when the coordinator last weighed a re-placement
        self._passed = trio.Event()  # set by each of them; wait re-checks

    def observe(self, seconds: Sequence[float], rows: int) -> None:
        """A pass of ``rows`` rows whose stages computed for ``seconds``, in order."""
        if self._book is None:
            return
        self._book.observe_pass(self._nodes, self._weight_bytes, seconds, rows)
        if rows == 1 and len(seconds) == len(self._nodes):
            self.passes += 1
            self._passed.set()

    @property
    def to_weigh(self) -> int:
        """One-row passes to wait for before asking :meth:`due` again (at least one)."""
        return max(self.weighed + MIN_SAMPLES - self.passes, 1)

    def due(self, now: float) -> bool:
        """Whether to weigh a re-placement by speed at trio time ``now``: every stage timed
        in :data:`MIN_SAMPLES` one-row passes since the last weighing, and the pipeline has
        served :data:`SERVE_BEFORE_REPLACING_S`. A True marks this weighing done."""
        if self.passes < self.weighed + MIN_SAMPLES:
            return False
        if now - self.created < SERVE_BEFORE_REPLACING_S:
            return False
        self.weighed = self.passes
        return True

    async def wait(self, passes: int) -> None:
        """Return once ``passes`` more one-row passes have timed every stage (from now)."""
        target = self.passes + passes
        while self.passes < target:
            self._passed = trio.Event()
            await self._passed.wait()


#: A pipeline serves this long before its measured speeds may re-place it: calibration
#: placed it by speed already, and a re-placement while serving costs a Load on every stage
#: with 503s meanwhile; what is left to catch is a node that got slower for good (a laptop
#: on battery, a new neighbour), which ten minutes of serving tell from passing noise.
SERVE_BEFORE_REPLACING_S = 600.0

#: A new plan must make a token at least this much faster to be worth moving a run: moving
#: costs every stage a Load (seconds) and the prefix caches, and rates wander by ~10 %
#: between passes on a shared machine.
MIN_GAIN = 0.2


#: ... and at least this many seconds a token faster: a re-placement costs seconds (a Load
#: on every stage), which 5 ms a token repays within a 400-token answer; and a tiny model's
#: stages take ~1 ms, where one-row timings on a busy machine wander by more than 20 %.
MIN_GAIN_S = 0.005


def worth_replacing(current_s: float, wanted_s: float, min_gain: float = MIN_GAIN) -> bool:
    """Whether a plan predicted at ``wanted_s`` a token beats one at ``current_s`` enough:
    by the fraction ``min_gain`` and by :data:`MIN_GAIN_S`."""
    return wanted_s < current_s * (1.0 - min_gain) and current_s - wanted_s >= MIN_GAIN_S


def should_replace(
    model: ModelFootprint, current: Plan, wanted: Plan | None, nodes: Sequence[NodeCapacity]
) -> bool:
    """Whether measured speeds call for moving a serving run from ``current`` to ``wanted``
    (the plan the planner makes now): every stage of both is measured in ``nodes`` and
    ``wanted`` is predicted enough faster (:func:`worth_replacing`) for one stream (a
    token's time end to end) or, no slower for one, for many (the slowest stage, which
    bounds the pipeline's throughput). A plan of the same ranges on the same nodes, or
    none, never is."""
    if wanted is None or _ranges(wanted) == _ranges(current):
        return False
    now = plan_seconds(model, nodes, current.stages)
    then = plan_seconds(model, nodes, wanted.stages)
    if now is None or then is None:
        return False
    (token_now, slowest_now), (token_then, slowest_then) = now, then
    many = token_then <= token_now and worth_replacing(slowest_now, slowest_then)
    return many or worth_replacing(token_now, token_then)


def _ranges(placed: Plan) -> tuple[tuple[str, int, int], ...]:
    return tuple((s.node_id, s.start, s.end) for s in placed.stages)
