"""Auto n-gram mode: cold watching, prompt shape, cost-driven backoff and cooldown."""

from __future__ import annotations

import random

from meshnode.speculative import auto
from meshnode.speculative.auto import AutoNgramProposer
from meshnode.speculative.ngram import NgramParams

PARAMS = NgramParams(min_n=2, max_n=3, max_proposal=4)


def prose(n: int, seed: int = 0) -> list[int]:
    """Tokens that never repeat a 2-gram: nothing for an n-gram lookup to find."""
    rng = random.Random(seed)
    return rng.sample(range(1000, 100_000), n)


def test_cold_mode_proposes_nothing_on_prose() -> None:
    proposer = AutoNgramProposer(PARAMS)
    history = prose(100)
    for token in prose(40, seed=1):
        assert proposer.propose(history, 4).tokens == ()
        proposer.on_result(0, 0, seconds=0.01)
        history.append(token)
    assert proposer.state == "cold"


def test_repetitive_prompt_turns_speculation_on_at_once() -> None:
    proposer = AutoNgramProposer(PARAMS)
    block = prose(10)
    history = block * 6  # a prompt quoting the same lines over and over
    assert proposer.propose(history, 4).tokens == tuple(block[:4])
    assert proposer.state == "on"
    assert "prompt repeats" in proposer.reason


def test_short_prompt_is_not_judged_by_shape() -> None:
    proposer = AutoNgramProposer(PARAMS)
    block = prose(4)
    assert proposer.propose(block * 3, 4).tokens == ()
    assert proposer.state == "cold"


def test_repeated_cold_hits_turn_speculation_on() -> None:
    """Output that starts copying an earlier passage is noticed with no verify spent."""
    proposer = AutoNgramProposer(PARAMS)
    passage = prose(30, seed=2)
    history = [*prose(60, seed=3), *passage, *prose(5, seed=4), *passage[:3]]
    copied = iter(passage[3:])
    steps = 0
    while not (proposal := proposer.propose(history, 4)).tokens:
        assert proposer.state == "cold"
        proposer.on_result(0, 0, seconds=0.01)
        history.append(next(copied))
        steps += 1
    # The first would-be proposal is scored after 4 committed tokens, the second after 4
    # more: two full matches in a row (COLD_STREAK_ON) turn it on.
    assert steps == 4 * auto.COLD_STREAK_ON
    assert proposer.state == "on"
    done = len(history) - 60 - 30 - 5
    assert proposal.tokens == tuple(passage[done : done + 4])


def run_on(
    proposer: AutoNgramProposer, history: list[int], windows: int, accept: int, verify_s: float
) -> None:
    """Drive ``windows`` verify passes that report ``accept`` accepted drafts each."""
    for _ in range(windows):
        proposal = proposer.propose(history, 4)
        if not proposal.tokens:
            break
        proposer.on_result(len(proposal.tokens), accept, seconds=verify_s)
        # Commit the true continuation so the lookup keeps matching: only the reported
        # counts matter to the controller.
        history.extend(proposal.tokens[: accept + 1])


def repetitive_start() -> tuple[AutoNgramProposer, list[int]]:
    proposer = AutoNgramProposer(PARAMS)
    history = prose(10) * 6
    proposer.propose(history, 4)
    assert proposer.state == "on"
    return proposer, history


def test_backs_off_when_verify_costs_more_than_plain_steps() -> None:
    proposer, history = repetitive_start()
    proposer.on_result(0, 0, seconds=0.010)  # a timed plain step
    # 0 of 4 accepted at 0.012 s a pass: 0.012 s per token against 0.010 s plain.
    run_on(proposer, history, auto.ON_MIN_WINDOWS, accept=0, verify_s=0.012)
    assert proposer.state == "cooldown"
    assert "verify costs 1.20x" in proposer.reason


def test_keeps_speculating_while_it_pays() -> None:
    proposer, history = repetitive_start()
    proposer.on_result(0, 0, seconds=0.010)
    # 2 of 4 accepted at 0.015 s: 0.005 s per token, half the plain cost.
    run_on(proposer, history, 3 * auto.ON_MIN_WINDOWS, accept=2, verify_s=0.015)
    assert proposer.state == "on"


def test_without_timings_a_low_accept_rate_backs_off() -> None:
    proposer, history = repetitive_start()
    for _ in range(auto.ON_MIN_WINDOWS):
        proposal = proposer.propose(history, 4)
        proposer.on_result(len(proposal.tokens), 0)  # untimed
        history.extend(proposal.tokens[:1])
    assert proposer.state == "cooldown"
    assert "accept rate 0.00" in proposer.reason


def state(proposer: AutoNgramProposer) -> str:
    return proposer.state


def test_cooldown_lasts_its_tokens_then_doubles() -> None:
    proposer, history = repetitive_start()
    proposer.on_result(0, 0, seconds=0.010)
    run_on(proposer, history, auto.ON_MIN_WINDOWS, accept=0, verify_s=0.05)
    assert state(proposer) == "cooldown"
    ended_at = len(history)
    fresh = iter(prose(200, seed=9))
    while proposer.propose(history, 4).tokens == () and state(proposer) == "cooldown":
        history.append(next(fresh))
    assert len(history) - ended_at == auto.COOLDOWN_TOKENS
    assert state(proposer) == "cold"
    # The output starts repeating again: cold hits turn it on, the cost is still bad, and
    # the second consecutive backoff lasts twice as long.
    block = prose(10)
    cycle = iter(block * 10)
    while not proposer.propose(history, 4).tokens:
        history.append(next(cycle))
    run_on(proposer, history, auto.ON_MIN_WINDOWS, accept=0, verify_s=0.05)
    assert state(proposer) == "cooldown"
    assert f"off for {2 * auto.COOLDOWN_TOKENS} tokens" in proposer.reason
