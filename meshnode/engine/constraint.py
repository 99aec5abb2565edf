"""Constrained decoding: a grammar's token mask on the logits rows of one sequence.

The grammar engine is llguidance (the one llama.cpp and vLLM use): it compiles a grammar
(JSON schema, Lark) against the tokenizer's vocabulary and, for any prefix of tokens,
gives the set of tokens that keep the output inside the grammar. This module applies it
where the logits are, on the last stage, one sequence at a time:

- :class:`Grammars` (one per stage) builds llguidance's tokenizer once, lazily (about half
  a second for a 49k vocabulary), and a :class:`Constraint` per constrained sequence.
- :class:`Constraint` holds the matcher of one sequence and the generated tokens it has
  consumed. Before each pass it is *synced* to the sequence's committed tokens: it rolls
  back what is no longer there and consumes what is new. So the matcher advances only on
  tokens the pass before accepted, and a rejected draft is undone exactly like the KV cache
  is (the next frame simply starts earlier); no message is needed for it.
- :meth:`Constraint.mask` masks the ``k + 1`` rows of a verify pass: row ``i`` with the
  grammar's state after the committed tokens and drafts ``d_1 … d_i``. The drafts are
  consumed tentatively and rolled back at once. At the first draft the grammar forbids,
  the masking stops: that row's mask makes the acceptance rule reject the draft (greedy:
  it is not the argmax of the masked row; sampling: its probability is 0), and the rows
  after it are never read. Greedy output is therefore the same with and without
  speculation, as it is unconstrained.

Forbidden tokens get ``-inf``, so every sampling rule (penalties, temperature, top-k/p,
min-p) sees a distribution with only grammatical tokens left. Once the grammar is complete
only EOS is allowed, which ends the reply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
from meshnode_packaging.errors import PackageError

from meshnode.errors import MeshnodeError

__all__ = ["Constraint", "GrammarError", "Grammars", "validate_grammar"]


class GrammarError(MeshnodeError, ValueError):
    """A grammar that cannot be compiled, or a token sequence the grammar forbids."""


def validate_grammar(grammar: str) -> str | None:
    """None if ``grammar`` (llguidance's serialized form) compiles, else why not."""
    message = llguidance.LLMatcher.validate_grammar(grammar)
    return message or None


class Grammars:
    """Builds the constraints of one stage's sequences (see the module docstring).

    ``tokenizer_json`` is called once, at the first constrained sequence (a stage that never
    sees one never reads its tokenizer); ``vocab_size`` is the width of the logits rows.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str | None],
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # stages compute in worker threads

    def constraint(self, grammar: str, start: int) -> Constraint:
        """A fresh constraint for one sequence whose constrained tokens begin at position
        ``start`` (the prompt's length). Raises GrammarError for a bad grammar or a model
        without a tokenizer."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, start)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    source = self._tokenizer_json()
                except (PackageError, OSError, ValueError) as exc:  # not materialized here
                    raise GrammarError(f"this stage cannot read the tokenizer: {exc}") from exc
                if source is None:
                    raise GrammarError("the model has no tokenizer, so no grammar applies")
                self._tokenizer = llguidance.LLTokenizer(
                    source, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer


class Constraint:
    """The grammar state of one sequence (see the module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, start: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        # The position of the first constrained token. It travels with the grammar rather
        # than being read off the prefill, so that a sequence prefilled again with its
        # generated tokens (a replay, a rollback behind a recurrent snapshot ring) still
        # feeds them to the grammar.
        self.start = start
        self.consumed: list[int] = []  # the generated tokens the matcher stands after

    def sync(self, generated: Sequence[int]) -> None:
        """Stand after exactly ``generated``: roll back what differs, consume the rest.

        Raises GrammarError if a token is one the grammar forbids (it was not chosen under
        this constraint: a peer's bug, or a replay of another grammar's output).
        """
        common = 0
        for mine, theirs in zip(self.consumed, generated, strict=False):
            if mine != theirs:
                break
            common += 1
        if common < len(self.consumed):
            self._matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        for token in generated[common:]:
            if not self._matcher.consume_token(token):
                raise GrammarError(f"token {token} is not allowed by the grammar here")
            self.consumed.append(token)

    def mask(self, rows: Any, drafts: Sequence[int] = ()) -> np.ndarray:
        """``rows`` (``[k + 1, V]`` logits, ``k = len(drafts)``) with the tokens the grammar
        forbids at each row set to ``-inf`` (a new float64 array); rows after the first
        forbidden draft are left as they are (the acceptance rule stops before them)."""
        out = np.array(rows, dtype=np.float64)
        taken = 0
        try:
            for i in range(out.shape[0]):
                allowed = self._allowed()
                out[i, ~allowed] = -np.inf
                if i == len(drafts) or not allowed[drafts[i]]:
                    break
                if not self._matcher.consume_token(drafts[i]):
                    break
                taken += 1
        finally:
            if taken:
                self._matcher.rollback(taken)
        return out

    def _allowed(self) -> np.ndarray:
        """The tokens allowed next, as a bool row ``[V]``."""
        if self._matcher.is_error():
            raise GrammarError(f"grammar: {self._matcher.get_error()}")
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed: np.ndarray = np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)
        if not allowed.any():
            raise GrammarError("the grammar allows no token here")
        return allowed
