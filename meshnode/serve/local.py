"""One reply from a whole model in this process, through the API's generation loop.

``meshnode generate``, the benchmarks and the tests of sampling and speculation drive
:func:`~meshnode.generation.driver.generate` here, over a
:class:`~meshnode.node.local.LocalPipeline` holding every layer: the same loop, stop
strings, EOS and budget rules, speculative windows, and last-stage sampling as a request
to the API, so a fix lands once. Only the shape of the result differs:
:func:`generate_local` gives token ids without the final EOS, the reply's text and
wall-clock timings, as ``meshnode generate --json`` prints them; :func:`generate_tokens`
(token ids in, no tokenizer) gives the finished
:class:`~meshnode.generation.records.GenerationRun` with its speculation counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import trio

from meshnode.engine.generate import PREFILL_CHUNK
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from meshnode.generation.driver import generate
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.state import FinishReason, GenerationParams, GenerationState
from meshnode.node.local import LocalPipeline
from meshnode.node.pipeline import RequestId
from meshnode.node.stage import StageRunner

__all__ = ["GenerationResult", "Timings", "generate_local", "generate_tokens"]

#: The one sequence of a local run.
LOCAL_REQUEST = RequestId("local")


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
    """Everything about a finished generation (``token_ids`` without a final EOS)."""

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
            "finish_reason": str(self.finish_reason),
            "timings": self.timings.as_dict(),
        }


def generate_local(
    stage: Stage,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    chunk_tokens: int = PREFILL_CHUNK,
) -> GenerationResult:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids`` with ``stage`` (every
    layer, embedding and head), calling ``on_text`` with each piece of reply text.

    Stops on an id in ``eos_ids`` (not in ``token_ids``) or when the text contains a
    string of ``stop`` (the text is cut before it). Blocking: it runs its own trio loop.
    Raises ``ValueError`` for an empty prompt or one that fills the model's context.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    limit = stage.config.max_position_embeddings
    if len(prompt_ids) >= limit:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the {limit} context")
    budget = min(max_tokens, limit - len(prompt_ids))
    runner = StageRunner(stage, context_size=len(prompt_ids) + budget, max_sequences=1)
    generation = GenerationParams(
        max_new_tokens=budget,
        sampling=params,
        stop=tuple(s for s in stop if s),
        eos_token_ids=frozenset(eos_ids),
    )
    state = GenerationState(generation, IncrementalDetokenizer(tokenizer))
    run = GenerationRun(LOCAL_REQUEST, list(prompt_ids), generation, state)
    text = trio.run(_drive, LocalPipeline(runner), run, on_text, chunk_tokens)
    return _result(run, text)


class _NoText:
    """The detokenizer of a token-ids-only run: no text."""

    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def generate_tokens(
    model: Stage | StageRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_new_tokens: int,
    speculation: Speculation | None = None,
    eos_ids: Sequence[int] = (),
    chunk_tokens: int = PREFILL_CHUNK,
) -> GenerationRun:
    """Up to ``max_new_tokens`` token ids after ``prompt_ids`` from ``model`` (a stage with
    every layer, embedding and head, or a runner over one), the API's way, speculating
    with ``speculation`` if given. Returns the finished run: ``run.state.tokens`` (a final
    EOS included) and ``run.spec``. Blocking: it runs its own trio loop.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    if isinstance(model, Stage):
        context = len(prompt_ids) + max_new_tokens
        model = StageRunner(model, context_size=context, max_sequences=1)
    generation = GenerationParams(
        max_new_tokens=max_new_tokens, sampling=params, eos_token_ids=frozenset(eos_ids)
    )
    run = GenerationRun(
        LOCAL_REQUEST, list(prompt_ids), generation, GenerationState(generation, _NoText())
    )
    trio.run(_drive, LocalPipeline(model), run, None, chunk_tokens, speculation)
    return run


async def _drive(
    pipeline: LocalPipeline,
    run: GenerationRun,
    on_text: Callable[[str], None] | None,
    chunk_tokens: int,
    speculation: Speculation | None = None,
) -> str:
    pieces: list[str] = []
    loop = generate(pipeline, run, speculation=speculation, chunk_tokens=chunk_tokens)
    async with aclosing(loop) as deltas:
        async for delta in deltas:
            pieces.append(delta.text)
            if on_text is not None and delta.text:
                on_text(delta.text)
    return "".join(pieces)


def _result(run: GenerationRun, text: str) -> GenerationResult:
    tokens = list(run.state.tokens)
    if tokens and tokens[-1] in run.params.eos_token_ids:
        tokens.pop()  # EOS ended the reply; it is not part of it
    timings = run.timings
    first = timings.first_token if timings.first_token is not None else timings.started
    finished = timings.finished if timings.finished is not None else first
    assert run.state.finish_reason is not None  # the loop runs until the reply finishes
    return GenerationResult(
        prompt_token_ids=list(run.prompt),
        token_ids=tokens,
        text=text,
        finish_reason=run.state.finish_reason,
        timings=Timings(
            prefill_ms=(first - timings.started) * 1e3,
            decode_ms=(finished - first) * 1e3,
            prompt_tokens=len(run.prompt),
            generated_tokens=len(tokens),
        ),
    )
