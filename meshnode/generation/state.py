"""The pure state of one completion: what the client sees, token by token.

:class:`GenerationState` commits tokens, detokenizes them incrementally, holds back text
that might be the start of a stop string (:mod:`meshnode.generation.stops`), and finishes
on EOS (``stop``), a stop string (``stop``) or the token budget (``length``). It does no
I/O, so its rules are tested directly; the driver (:mod:`meshnode.generation.driver`)
feeds it what each pipeline pass returns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from meshnode.generation.stops import find_stop, first_stop, held_back

if TYPE_CHECKING:
    from meshnode.engine.sampling import SamplingParams
    from meshnode.node.pipeline import TokenLogprob


class FinishReason(enum.StrEnum):
    """Why a completion ended, as OpenAI names it."""

    STOP = "stop"
    LENGTH = "length"


class Detokenizer(Protocol):
    """Turns token ids into text incrementally, never splitting a UTF-8 character."""

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        ...

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes lossily)."""
        ...


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What one request asks of the generation loop: the endpoints build it from their
    bodies (``max_new_tokens`` None: what the context leaves), and the service fits it to
    the prompt and the model (:meth:`within`) before the loop runs it."""

    max_new_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None
    # The grammar the reply must follow (llguidance's serialized form; None: free text),
    # enforced by the last stage (meshnode.serve.structured, meshnode.engine.constraint).
    grammar: str | None = None
    cache_prompt: bool = True  # resume from the stages' cached prefix (llama-server's field)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def budget(self) -> int:
        """The most tokens the reply may have; raises ``ValueError`` before :meth:`within`
        set one (a request that named none)."""
        if self.max_new_tokens is None:
            raise ValueError("the token budget is set by within() before generation")
        return self.max_new_tokens

    def within(self, room: int, eos_token_ids: frozenset[int]) -> GenerationParams:
        """These parameters for a prompt that leaves ``room`` tokens of context (``>= 1``),
        with the model's end-of-sequence tokens: the budget clamped to the room."""
        budget = min(self.max_new_tokens or room, room)
        return replace(self, max_new_tokens=budget, eos_token_ids=eos_token_ids)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step adds to the reply: text, the tokens behind it, and maybe the end."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class GenerationState:
    """Committed tokens and emitted text of one completion (pure; see module docstring)."""

    params: GenerationParams
    detokenizer: Detokenizer
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    #: The stop string that ended the reply (None: EOS, the budget, or not finished).
    stop_string: str | None = None
    _pending: str = ""

    @property
    def finished(self) -> bool:
        """Whether the completion has ended (further commits are an error)."""
        return self.finish_reason is not None

    def commit(
        self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None
    ) -> Delta:
        """Commit the tokens of one step, in order, until one of them finishes the reply.

        Tokens after the finishing one are dropped (a verify pass can overshoot a stop
        string or the budget). Returns the text the client may see now.
        """
        if self.finished:
            raise RuntimeError("commit after the completion finished")
        text: list[str] = []
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            text.append(self._commit_one(token))
            if self.finished:
                break
        kept_logprobs = tuple(logprobs[: len(kept)]) if logprobs else ()
        return Delta("".join(text), tuple(kept), kept_logprobs, self.finish_reason)

    def _commit_one(self, token: int) -> str:
        self.tokens.append(token)
        if token in self.params.eos_token_ids:
            # EOS counts as a completion token (it was generated) but is never shown.
            return self._finish(FinishReason.STOP, self._pending + self.detokenizer.flush())
        self._pending += self.detokenizer.push(token)
        cut = find_stop(self._pending, self.params.stop)
        if cut is not None:
            self.stop_string = first_stop(self._pending, self.params.stop)
            return self._finish(FinishReason.STOP, self._pending[:cut])
        if len(self.tokens) >= self.params.budget:
            return self._finish(FinishReason.LENGTH, self._pending + self.detokenizer.flush())
        keep = held_back(self._pending, self.params.stop)
        ready, self._pending = (
            self._pending[: len(self._pending) - keep],
            self._pending[len(self._pending) - keep :],
        )
        return ready

    def _finish(self, reason: FinishReason, text: str) -> str:
        self.finish_reason = reason
        self._pending = ""
        return text


def prefill_chunks(prompt: Sequence[int], chunk_tokens: int) -> list[tuple[int, list[int]]]:
    """``(start_pos, tokens)`` chunks covering the prompt, in order."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk_tokens}")
    return [
        (start, list(prompt[start : start + chunk_tokens]))
        for start in range(0, len(prompt), chunk_tokens)
    ]
