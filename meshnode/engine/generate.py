"""Single-node generation as a ladder of small functions (after gpt-fast's generate.py).

``prefill`` → ``decode_one`` → ``generate``. Nothing here does I/O: ``generate`` yields
text deltas and a final :class:`GenerationResult`; the caller prints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import Stage
from meshnode.engine.sampling import Sampler, SamplingParams
from meshnode.engine.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "PREFILL_CHUNK",
    "FinishReason",
    "GenerationResult",
    "TextDelta",
    "Timings",
    "decode_one",
    "generate",
    "prefill",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TextDelta:
    """One sampled token and the text it completed (maybe empty).

    ``token_id`` is None for the held-back text released when generation ends.
    """

    token_id: int | None
    text: str


@dataclass(frozen=True)
class Timings:
    """Wall-clock costs of one generation."""

    prefill_ms: float
    decode_ms: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens processed per second."""
        return self.prompt_tokens / max(self.prefill_ms, 1e-9) * 1e3

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated per second after the first one (which prefill produced)."""
        return max(self.generated_tokens - 1, 0) / max(self.decode_ms, 1e-9) * 1e3

    def as_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {
            "prefill_ms": round(self.prefill_ms, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_ms": round(self.decode_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
        }


@dataclass(frozen=True)
class GenerationResult:
    """Everything about a finished generation."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    timings: Timings = field(repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``--json`` line of ``meshnode generate``)."""
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "timings": self.timings.as_dict(),
        }


# Prompt tokens per forward during prefill (llama.cpp's default batch is also 512): the
# attention scores of one chunk are [H, chunk, T] floats, so an 8k-token prompt in one
# forward would need 2+ GB for them; in chunks of 512 it needs 1/16 of that.
PREFILL_CHUNK = 512


def prefill(
    stage: Stage, cache: KVCache, prompt_ids: Sequence[int], chunk: int = PREFILL_CHUNK
) -> np.ndarray:
    """Run the prompt from position 0 in chunks; return the next-token logits ``[V]``."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    for start in range(0, len(ids), chunk):
        logits = stage.forward(ids[start : start + chunk], start, cache, out_rows=1)
    return stage.backend.to_numpy(logits[-1])


def decode_one(stage: Stage, cache: KVCache, token: int, pos: int) -> np.ndarray:
    """Feed one token at ``pos``; return the next-token logits ``[V]``."""
    logits = stage.forward(np.asarray([token], dtype=np.int64), pos, cache)
    return stage.backend.to_numpy(logits[-1])


class _StopMatcher:
    """Finds stop strings in streamed text, holding back a possible partial match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # everything released so far
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return (text safe to release, whether a stop string was hit)."""
        self.pending += delta
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            self.text += out
            return out, True
        hold = max((_overlap(self.pending, s) for s in self.stops), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        self.text += out
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        self.text += out
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def generate(
    stage: Stage,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
) -> Iterator[TextDelta | GenerationResult]:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids``.

    Yields a :class:`TextDelta` per sampled token, then one :class:`GenerationResult`.
    Stops on an id in ``eos_ids`` (not included in the output) or when the text contains
    a string of ``stop`` (the text is cut before it). Raises ``ValueError`` for an empty
    prompt or a context longer than the model's.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    limit = stage.config.max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the {limit} context")
    max_tokens = min(max_tokens, limit - len(prompt_ids))
    cache = stage.new_cache(len(prompt_ids) + max_tokens)
    sampler = Sampler(params)
    detok = IncrementalDetokenizer(tokenizer)
    stops = _StopMatcher(stop)
    tokens: list[int] = []
    finish: FinishReason = "length"
    hit = False
    t0 = time.perf_counter()
    logits = prefill(stage, cache, prompt_ids)
    t1 = time.perf_counter()
    while len(tokens) < max_tokens:
        token = sampler.sample(logits, tokens)
        if token in eos_ids:
            finish = "stop"
            break
        tokens.append(token)
        text, hit = stops.feed(detok.push(token))
        yield TextDelta(token, text)
        if hit:
            finish = "stop"
            break
        if len(tokens) < max_tokens:
            logits = decode_one(stage, cache, token, len(prompt_ids) + len(tokens) - 1)
    t2 = time.perf_counter()
    if not hit:
        # Release what the detokenizer and the stop matcher were still holding back.
        tail, hit = stops.feed(detok.flush())
        tail += "" if hit else stops.flush()
        finish = "stop" if hit else finish
        if tail:
            yield TextDelta(None, tail)
    timings = Timings((t1 - t0) * 1e3, (t2 - t1) * 1e3, len(prompt_ids), len(tokens))
    yield GenerationResult(list(prompt_ids), tokens, stops.text, finish, timings)
