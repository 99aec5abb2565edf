"""The coordinator's pure decisions (:mod:`meshnode.node.decisions`), as tables."""

from __future__ import annotations

import pytest

from meshnode.node.decisions import (
    BLAME_COOL_OFF_S,
    CLAIM_RETRY_FIRST_S,
    CLAIM_RETRY_MAX_S,
    UNTRACED_LOSSES_TO_BLAME,
    BackedOff,
    BackOff,
    BringUpFailed,
    CoordinatorState,
    Event,
    Failure,
    FailureKind,
    MembershipChanged,
    NoFit,
    Planned,
    Probed,
    Refusal,
    Replaced,
    Replan,
    Serving,
    Stage0Hung,
    StageFailed,
    claim_retry_delay,
    next_action,
    retry_delay,
)

FRESH = CoordinatorState()


def _probe(answers: dict[str, int | None], now: float = 100.0) -> Probed:
    return Probed("a pass did not come back", tuple(answers), answers, 30_000, now)


def test_claim_retries_double_up_to_their_cap() -> None:
    assert [claim_retry_delay(n) for n in (1, 2, 3)] == [CLAIM_RETRY_FIRST_S * f for f in (1, 2, 4)]
    assert claim_retry_delay(40) == CLAIM_RETRY_MAX_S


@pytest.mark.parametrize(
    ("state", "event", "expected", "action"),
    [
        (FRESH, Planned(), CoordinatorState(first_plan=False), None),
        (
            FRESH,
            NoFit("too few nodes"),
            CoordinatorState(error=Failure(FailureKind.NO_FIT, "too few nodes")),
            None,
        ),
        (CoordinatorState(excluded=frozenset({"a"})), MembershipChanged(), FRESH, None),
        # A node that did not do its part is excluded; the retry backs off.
        (
            FRESH,
            BringUpFailed("node a did not answer", 10.0, failed=frozenset({"a"})),
            CoordinatorState(
                excluded=frozenset({"a"}),
                failures=1,
                recovering=True,
                error=Failure(FailureKind.BRING_UP, "node a did not answer", "a"),
                last_failure=Failure(FailureKind.BRING_UP, "node a did not answer", "a"),
            ),
            BackOff(retry_delay(1)),
        ),
        # A node that refused the Claim is not excluded: it is claimed again later (item 7).
        (
            FRESH,
            BringUpFailed("node a refused Claim", 10.0, refused=frozenset({"a"})),
            CoordinatorState(
                refused={"a": Refusal(10.0 + CLAIM_RETRY_FIRST_S, 1)},
                failures=1,
                recovering=True,
                error=Failure(FailureKind.BRING_UP, "node a refused Claim", "a"),
                last_failure=Failure(FailureKind.BRING_UP, "node a refused Claim", "a"),
            ),
            BackOff(retry_delay(1)),
        ),
        (CoordinatorState(error=Failure(FailureKind.BRING_UP, "x")), BackedOff(), FRESH, None),
        # Serving: the failures in a row end, and the claims it holds were accepted.
        (
            CoordinatorState(failures=3, refused={"a": Refusal(9.0, 2), "b": Refusal(9.0, 1)}),
            Serving(("host", "a")),
            CoordinatorState(refused={"b": Refusal(9.0, 1)}),
            None,
        ),
        (
            FRESH,
            StageFailed("a", "stage node a left the mesh", left=True),
            FRESH,
            Replan(Failure(FailureKind.STAGE_LEFT, "stage node a left the mesh", "a")),
        ),
        (
            FRESH,
            StageFailed("a", "send to a failed", exclude=True),
            CoordinatorState(excluded=frozenset({"a"})),
            Replan(Failure(FailureKind.STAGE_LOST, "send to a failed", "a")),
        ),
        (
            CoordinatorState(recovering=True),
            Replaced(None),
            FRESH,
            None,
        ),
        (
            FRESH,
            Replaced(Failure(FailureKind.STAGE_LOST, "lost", "a")),
            CoordinatorState(
                recovering=True, last_failure=Failure(FailureKind.STAGE_LOST, "lost", "a")
            ),
            None,
        ),
        (CoordinatorState(error=Failure(FailureKind.STAGE0_HUNG, "x")), Stage0Hung(0), FRESH, None),
    ],
)
def test_next_action(
    state: CoordinatorState, event: Event, expected: CoordinatorState, action: object
) -> None:
    assert next_action(state, event) == (expected, action)


@pytest.mark.parametrize(
    ("answers", "blamed"),
    [
        ({"a": None, "b": 0}, "a"),  # silent or runless: the probe's own evidence
        ({"a": 0, "b": 90_000}, "b"),  # a pass in progress for 90 s
        ({"a": 0, "b": 0}, None),  # every stage idle: one untraced loss blames nobody yet
    ],
)
def test_the_probe_blames_what_it_can(answers: dict[str, int | None], blamed: str | None) -> None:
    state, action = next_action(FRESH, _probe(answers))
    assert isinstance(action, Replan)
    assert action.loss.node == blamed
    assert action.loss.kind is (FailureKind.UNTRACED if blamed is None else FailureKind.BLAMED)
    assert set(state.cooling_off(100.0)) == ({blamed} if blamed else set())


def test_a_stage_that_answers_idle_but_loses_pass_after_pass_is_blamed() -> None:
    """Issue 36 item 5: the host sees the reply missing each time; the stage's "idle" is
    not taken for it. The one remote stage is blamed on the second untraced loss."""
    state = FRESH
    losses = []
    for i in range(UNTRACED_LOSSES_TO_BLAME):
        state, action = next_action(state, _probe({"w": 0}, now=100.0 + i))
        assert isinstance(action, Replan)
        losses.append(action.loss)
    assert [loss.node for loss in losses[:-1]] == [None] * (UNTRACED_LOSSES_TO_BLAME - 1)
    assert losses[-1].node == "w"
    assert losses[-1].kind is FailureKind.BLAMED
    assert "blamed on stage node w" in str(losses[-1])
    assert state.kept_out(102.0) == {"w"}
    assert state.untraced == {}  # its suspicions are spent on the blame


def test_the_stage_in_most_untraced_losses_is_blamed_first_in_order_on_a_tie() -> None:
    state, _ = next_action(FRESH, _probe({"b": 0}, now=1.0))
    state, action = next_action(state, _probe({"a": 0, "b": 0}, now=2.0))
    assert isinstance(action, Replan)
    assert action.loss.node == "b"  # suspect twice, "a" once
    state, _ = next_action(FRESH, _probe({"a": 0, "b": 0}, now=1.0))
    state, action = next_action(state, _probe({"a": 0, "b": 0}, now=2.0))
    assert isinstance(action, Replan)
    assert action.loss.node == "a"  # a tie: the first in pipeline order


def test_untraced_losses_far_apart_blame_nobody() -> None:
    state, _ = next_action(FRESH, _probe({"w": 0}, now=0.0))
    state, action = next_action(state, _probe({"w": 0}, now=BLAME_COOL_OFF_S + 1.0))
    assert isinstance(action, Replan)
    assert action.loss.node is None
    assert state.untraced == {"w": (BLAME_COOL_OFF_S + 1.0,)}


def test_nodes_left_out_and_when_they_come_back() -> None:
    state = CoordinatorState(
        excluded=frozenset({"x"}),
        cooling={"c": 50.0, "old": 5.0},
        refused={"r": Refusal(20.0, 1)},
    )
    assert state.kept_out(10.0) == {"x", "c", "r"}
    assert state.wake_at(10.0) == 20.0  # the refused node is due first
    assert state.kept_out(30.0) == {"x", "c"}
    assert state.wake_at(30.0) == 50.0
    assert state.wake_at(60.0) is None  # only a membership change frees "x"
    assert state.cooling_off(10.0) == {"c": 40.0}


def test_a_node_refused_again_waits_longer() -> None:
    state, _ = next_action(FRESH, BringUpFailed("refused", 0.0, refused=frozenset({"a"})))
    state, _ = next_action(state, BringUpFailed("refused", 20.0, refused=frozenset({"a"})))
    assert state.refused["a"] == Refusal(20.0 + claim_retry_delay(2), 2)
    assert "a" not in state.excluded
