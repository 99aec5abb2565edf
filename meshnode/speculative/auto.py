"""Auto n-gram mode: speculate only while it pays.

An n-gram proposer that is wrong most of the time makes every decode step a k + 1 row
verify pass for nothing. Auto mode wraps ``NgramProposer`` in a three-state controller:

``cold``
    Proposes nothing. Each step it computes the proposal it *would* have made and, as the
    committed tokens arrive, scores it against them ("cold hits", no verify spent). It
    turns speculation on when the prompt looks repetitive (code, structured text:
    ``SHAPE_*``), when ``COLD_STREAK_ON`` would-be proposals in a row matched in full, or
    when the cold accept rate reaches ``COLD_ACCEPT_RATE_ON``.
``on``
    Proposes. After ``ON_MIN_WINDOWS`` verify passes it compares the measured cost per
    committed token of verify passes with the measured plain decode step; when that ratio
    reaches ``COST_RATIO_OFF`` (or, before any plain step was timed, when the accept rate
    falls under ``MIN_ACCEPT_RATE``), it backs off.
``cooldown``
    Proposes nothing for a number of committed tokens that doubles with each consecutive
    backoff (``COOLDOWN_TOKENS`` … ``MAX_COOLDOWN_TOKENS``), then returns to ``cold``.

The controller is pure bookkeeping: step times come in through ``on_result(seconds=…)``
from the driver, which owns the clock; the cooldown counts committed tokens, not time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from meshnode.speculative.ngram import NgramParams, NgramProposer
from meshnode.speculative.proposer import EMPTY_PROPOSAL, Proposal, common_prefix

AutoState = Literal["cold", "on", "cooldown"]

# --- prompt shape -------------------------------------------------------------------------
# A prompt shorter than this says too little about its shape; judge by cold hits instead.
SHAPE_MIN_PROMPT_TOKENS = 48
# Fraction of the prompt's min_n-grams that already occurred earlier in the prompt. Measured
# on SmolLM2's tokenizer with its chat template: code and JSON edit requests 0.22-0.24,
# questions, an email request and a prose paragraph to summarise 0.02-0.06.
SHAPE_REPEAT_FRACTION_ON = 0.15

# --- cold watching ------------------------------------------------------------------------
# Would-be proposals matched in full, in a row, that turn speculation on: repeated suffix
# hits mean the output is copying (a list, a refactor, a quoted block).
COLD_STREAK_ON = 2
# Would-be proposals scored before the cold accept rate may turn speculation on.
COLD_MIN_PROPOSALS = 4
# Cold accept rate (matched drafts / would-be drafts, exponential average) that turns it
# on. At 0.5 a 4-token window commits ~1.9 tokens per pass, enough to beat the verify
# overhead of a CPU or single-GPU step.
COLD_ACCEPT_RATE_ON = 0.5

# --- while on -----------------------------------------------------------------------------
# Verify passes before the controller judges them. A reply often rephrases its first lines
# before it copies: judged after 4 windows, auto backed off the code-editing replies of
# benchmarks/speculative.py just before their copying stretch (1.66x of plain decoding in
# one process, 2.02x with 8; the chat set unchanged).
ON_MIN_WINDOWS = 8
# Back off when a verify pass costs this many plain steps per committed token or more.
COST_RATIO_OFF = 1.0
# Without a timed plain step (it turned on at once from the prompt shape) judge by the
# accept rate: below 0.3 a window commits little more than the one token a plain step does.
MIN_ACCEPT_RATE = 0.3

# --- cooldown -----------------------------------------------------------------------------
# Committed tokens spent without speculating after a backoff, doubled per consecutive
# backoff so that a request that never profits stops paying for cold-to-on probes.
COOLDOWN_TOKENS = 16
MAX_COOLDOWN_TOKENS = 512

# Weight of the newest sample in every exponential average: about the last 8 steps count.
EMA_ALPHA = 0.25


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_ALPHA * (new - old)


@dataclass(slots=True)
class _Pending:
    """A would-be proposal made in cold mode at history length ``start``."""

    start: int
    tokens: list[int]


class AutoNgramProposer:
    """N-gram proposer that watches cold, speculates while it pays, and backs off."""

    def __init__(self, params: NgramParams | None = None) -> None:
        self.ngram = NgramProposer(params)
        self.state: AutoState = "cold"
        self.reason = "watching would-be n-gram hits"
        self._shape_checked = False
        self._pending: _Pending | None = None
        self._cold_rate: float | None = None
        self._cold_scored = 0
        self._cold_streak = 0
        self._accept_rate: float | None = None
        self._verify_cost: float | None = None  # seconds per committed token, verify passes
        self._plain_cost: float | None = None  # seconds per plain decode step
        self._windows = 0
        self._backoffs = 0
        self._cooldown_until = 0

    # -- Proposer protocol -------------------------------------------------------------

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        """Drafts while ``on``; an empty proposal while ``cold`` or cooling down."""
        self.ngram.sync(history)
        if not self._shape_checked:
            self._check_shape()
        if self.state == "cooldown" and len(history) >= self._cooldown_until:
            self._enter("cold", "cooldown over")
        if self.state == "cold":
            self._watch(history, max_tokens)
        if self.state != "on":
            return EMPTY_PROPOSAL
        return self.ngram.propose(history, max_tokens)

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        """Update the cost model and, while ``on``, decide whether to back off."""
        if proposed == 0:
            if seconds is not None:
                self._plain_cost = _ema(self._plain_cost, seconds)
            return
        self._windows += 1
        self._accept_rate = _ema(self._accept_rate, accepted / proposed)
        if seconds is not None:
            self._verify_cost = _ema(self._verify_cost, seconds / (accepted + 1))
        if self.state == "on" and self._windows >= ON_MIN_WINDOWS:
            self._judge(history_len=len(self.ngram.index) + accepted + 1)

    # -- cold ----------------------------------------------------------------------------

    def _check_shape(self) -> None:
        self._shape_checked = True
        index = self.ngram.index
        ngrams = len(index) - index.min_n
        if len(index) < SHAPE_MIN_PROMPT_TOKENS or ngrams <= 0:
            return
        fraction = index.repeats / ngrams
        if fraction >= SHAPE_REPEAT_FRACTION_ON:
            self._enter("on", f"prompt repeats itself ({fraction:.2f} of its n-grams)")

    def _watch(self, history: Sequence[int], max_tokens: int) -> None:
        pending = self._pending
        if pending is not None:
            arrived = history[pending.start : pending.start + len(pending.tokens)]
            matched = common_prefix(pending.tokens, arrived)
            if matched == len(arrived) < len(pending.tokens):
                return  # still consistent, wait for more committed tokens
            self._pending = None
            self._score_cold(len(pending.tokens), matched)
            if self.state != "cold":
                return
        would_be = self.ngram.lookup(history, max_tokens)
        if would_be:
            self._pending = _Pending(len(history), would_be)

    def _score_cold(self, proposed: int, matched: int) -> None:
        self._cold_scored += 1
        self._cold_rate = _ema(self._cold_rate, matched / proposed)
        self._cold_streak = self._cold_streak + 1 if matched == proposed else 0
        if self._cold_streak >= COLD_STREAK_ON:
            self._enter("on", f"{self._cold_streak} would-be proposals in a row matched")
        elif self._cold_scored >= COLD_MIN_PROPOSALS and self._cold_rate >= COLD_ACCEPT_RATE_ON:
            self._enter("on", f"cold accept rate {self._cold_rate:.2f}")

    # -- on ------------------------------------------------------------------------------

    def _judge(self, history_len: int) -> None:
        if self._plain_cost is not None and self._verify_cost is not None:
            ratio = self._verify_cost / self._plain_cost
            if ratio >= COST_RATIO_OFF:
                self._back_off(history_len, f"verify costs {ratio:.2f}x a plain step per token")
            elif self._backoffs:
                self._backoffs = 0  # paying again: the next backoff starts short
        elif self._accept_rate is not None and self._accept_rate < MIN_ACCEPT_RATE:
            self._back_off(history_len, f"accept rate {self._accept_rate:.2f}")

    def _back_off(self, history_len: int, why: str) -> None:
        tokens = min(MAX_COOLDOWN_TOKENS, COOLDOWN_TOKENS << self._backoffs)
        self._backoffs += 1
        self._cooldown_until = history_len + tokens
        self._enter("cooldown", f"{why}; off for {tokens} tokens")

    def _enter(self, state: AutoState, reason: str) -> None:
        self.state = state
        self.reason = reason
        self._pending = None
        self._cold_streak = 0
        self._cold_scored = 0
        self._cold_rate = None
        if state == "on":
            self._windows = 0
            self._accept_rate = None
            self._verify_cost = None
