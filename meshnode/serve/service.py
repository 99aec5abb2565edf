"""The serving service: one model, its tokenizer, its pipeline, admission and metrics.

Route handlers (``openai_api``) translate the OpenAI schema into calls on
:class:`ServeService` in a few lines; everything that decides something about a request
(prompt building, limits, clamping, sampling parameters) lives here, below HTTP.

A request's life: :meth:`ServeService.start` takes its place in the scheduler's queue,
waits for a slot, and only then renders and tokenizes its prompt, in a worker thread (a
multi-megabyte prompt takes seconds to tokenize: on the event loop it would stall every
connection and the mesh's heartbeats); :meth:`ServeService.stream` (or ``complete``) runs
it and frees the slot at its end; :meth:`ServeService.finish` frees it for a run that is
never streamed (a response that failed to start).

The pipeline is swappable: the coordinator sets it when the mesh is ready and clears it
while the mesh (re)loads, during which requests get 503 with ``Retry-After``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

import trio

from meshnode.engine.kv_cache import KV_BLOCK
from meshnode.engine.sampling import SamplingParams
from meshnode.generation.driver import generate
from meshnode.generation.records import DEFAULT_PREFILL_CHUNK_TOKENS, GenerationRun, Speculation
from meshnode.generation.state import Delta, Detokenizer, GenerationParams, GenerationState
from meshnode.node.pipeline import PagedPipeline, Pipeline, PipelineError, RequestId, StepResult
from meshnode.node.prefix import request_blocks
from meshnode.serve.errors import (
    BadRequestError,
    ContextLengthError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from meshnode.serve.metrics import ServeMetrics
from meshnode.serve.scheduler import Scheduler, SchedulerLimits, Ticket
from meshnode.serve.speculation import SpeculationHost
from meshnode.serve.toolparse import ToolFormat
from meshnode.serve.tools import ToolSpec
from meshnode.speculative.telemetry import SpecStats

log = logging.getLogger(__name__)

#: The 503 message of a service told nothing more about why it has no pipeline.
LOADING_MESSAGE = "The mesh is loading the model; retry shortly."


class TextCodec(Protocol):
    """What the service needs from a tokenizer and chat template."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts."""
        ...

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``, special tokens parsed; with ``add_special`` the ids the
        model expects first (its BOS) are added unless the text starts with them."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included."""
        ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for a chat (messages as :func:`meshnode.serve.tools.render_chat`
        takes them), ending with the assistant's turn opened (unless not
        ``add_generation_prompt``)."""
        ...

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (from its chat template)."""
        ...

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token written ``text``, or None if there is none."""
        ...

    def token_text(self, token: int) -> str:
        """The text of one token on its own (for logprobs)."""
        ...

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for one completion."""
        ...


T = TypeVar("T")

#: Builds a request's prompt ids; called once the request holds a slot, in a worker thread.
PromptSource = Callable[[], list[int]]
#: Prompts rendered and tokenized at once, in worker threads. A 2 MiB prompt is seconds of
#: one core's work (tokenizers releases the GIL): more at once than a small host has cores
#: would only slow each of them down.
MAX_TOKENIZING = 4


def checked_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The model's sampling defaults that are valid settings, each checked alone; one the
    sampling record refuses is dropped with a warning (a model file's odd value must not
    turn every request that omits the field into a 500)."""
    names = {spec.name: spec.type for spec in dataclasses.fields(SamplingParams)}
    kept: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in names or name == "seed":
            continue
        if names[name] == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)  # a JSON 40.0 for top_k
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as exc:
            log.warning("ignoring the model's default %s=%r: %s", name, value, exc)
            continue
        kept[name] = value
    return kept


class ServeService:
    """One served model: validation, admission, generation and metrics around a pipeline."""

    def __init__(
        self,
        *,
        model_id: str,
        codec: TextCodec,
        context_size: int,
        eos_token_ids: frozenset[int],
        pipeline: Pipeline | None = None,
        aliases: Sequence[str] = (),
        limits: SchedulerLimits | None = None,
        speculation: Speculation | None = None,
        spec_host: SpeculationHost | None = None,
        chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        generation_defaults: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        """``spec_host`` (the node's live strategy, rebuilt on replans) wins over a fixed
        ``speculation``; with neither, requests decode one token per pass.
        ``generation_defaults`` are the model's sampling settings (fields of
        :class:`SamplingParams`) for requests that omit them."""
        self.model_id = model_id
        self.aliases = frozenset(aliases) | {model_id}
        self.codec = codec
        self.context_size = context_size
        self.eos_token_ids = eos_token_ids
        self.pipeline = pipeline
        self.scheduler = Scheduler(limits)
        scheduler = self.scheduler
        self.metrics = ServeMetrics(
            waiting=lambda: scheduler.waiting + scheduler.waiting_for_blocks
        )
        self._speculation = speculation
        self.spec_host = spec_host
        self.spec_total = SpecStats()  # every finished request's counters, summed
        self.chunk_tokens = chunk_tokens
        self.generation_defaults = checked_defaults(generation_defaults or {})
        self.created = int(clock())
        self._clock = clock
        #: Why no pipeline serves now: the 503 message (the host sets one that reads the
        #: coordinator's state; :func:`meshnode.serve.availability.unavailable_message`).
        self.unavailable_reason: Callable[[], str] = lambda: LOADING_MESSAGE
        self._tickets: dict[RequestId, Ticket] = {}  # of runs started and not yet finished
        self._pipeline_set = trio.Event()  # set (and renewed) by every set_pipeline
        self._tokenizing = trio.CapacityLimiter(MAX_TOKENIZING)

    # -- state ----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether a pipeline is loaded and requests are served."""
        return self.pipeline is not None

    def set_pipeline(self, pipeline: Pipeline | None) -> None:
        """Serve on ``pipeline`` from now on; ``None`` means the mesh is (re)loading."""
        self.pipeline = pipeline
        self._pipeline_set.set()
        self._pipeline_set = trio.Event()

    async def next_pipeline(self, lost: Pipeline) -> Pipeline:
        """The pipeline served after ``lost``, once the mesh has one (the generation loop
        replays a request there and bounds the wait)."""
        while self.pipeline is None or self.pipeline is lost:
            await self._pipeline_set.wait()
        return self.pipeline

    @property
    def speculation(self) -> Speculation | None:
        """How a request admitted now speculates (``None``: it does not)."""
        if self.spec_host is not None:
            return self.spec_host.speculation()
        return self._speculation

    def speculation_status(self) -> dict[str, Any]:
        """Live strategy, acceptance so far and warnings, for ``meshnode status``."""
        if self.spec_host is not None:
            return self.spec_host.status(self.spec_total)
        live = self._speculation
        total = self.spec_total
        return {
            "strategy": "off" if live is None else live.strategy,
            "acceptance": {
                "windows": total.windows,
                "proposed": total.proposed,
                "accepted": total.accepted,
                "accept_rate": total.accept_rate,
                "tokens_per_verify": total.tokens_per_verify,
                "cost_per_accepted_token_s": total.cost_per_accepted_token,
            },
            "warnings": [],
        }

    def now(self) -> int:
        """Unix seconds, for the ``created`` fields of responses."""
        return int(self._clock())

    # -- request checks -------------------------------------------------------------

    def require_model(self, model: str) -> None:
        """Raise ModelNotFoundError unless ``model`` names the served model."""
        if model not in self.aliases:
            raise ModelNotFoundError(model)

    def _require_pipeline(self) -> Pipeline:
        if self.pipeline is None:
            raise ServiceUnavailableError(self.unavailable_reason())
        return self.pipeline

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec] = (),
        *,
        continue_with: str = "",
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template (and ``tools``);
        ``continue_with`` starts the assistant's reply (a prefill the model continues);
        without ``add_generation_prompt`` the chat ends with its last turn."""
        text = self.codec.render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
        return self.codec.encode(text + continue_with)

    def sampling(self, given: Mapping[str, Any]) -> SamplingParams:
        """The sampling record of a request that gave the fields ``given``.

        Precedence, per field: the request's value, else the model's generation defaults
        (:attr:`generation_defaults`), else :class:`SamplingParams`' own (OpenAI's).
        """
        return SamplingParams(**{**self.generation_defaults, **given})

    def check_token_ids(self, ids: Sequence[int], *, param: str) -> None:
        """Raise BadRequestError (naming ``param``) for an id outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.codec.vocab_size]
        if bad:
            last = self.codec.vocab_size - 1
            raise BadRequestError(
                f"Token id {bad[0]} is outside the vocabulary (0..{last}).", param=param
            )

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt given as text or ids (checked against the vocab)."""
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        else:
            self.check_token_ids(prompt, param="prompt")
            ids = list(prompt)
        if not ids:
            raise BadRequestError("The prompt is empty.", param="prompt")
        return ids

    async def start(self, prompt: PromptSource, request: GenerationParams) -> GenerationRun:
        """Admit a request, then build its prompt and its run (see the module docstring).

        ``prompt`` runs in a worker thread once the request holds a slot; what it raises
        (BadRequestError, a template error) is raised here. The run holds its slot until
        :meth:`stream` ends or :meth:`finish` is called. Raises ServiceUnavailableError
        (loading or saturated) and ContextLengthError.
        """
        self._require_pipeline()
        ticket = self.scheduler.enter()
        try:
            await ticket.acquire()
            ids = await self.tokenize(prompt)
            run = self._new_run(ids, request)
            await self._take_blocks(ticket, run)
        except BaseException:
            ticket.release()
            raise
        self._tickets[run.request_id] = ticket
        return run

    async def _take_blocks(self, ticket: Ticket, run: GenerationRun) -> None:
        """Hold the KV blocks ``run`` may write on a pipeline with pools of blocks (its
        prompt, its clamped ``max_tokens`` and a verify pass's drafts), waiting for room
        (:meth:`Ticket.take_blocks`). Raises ContextLengthError if no pool ever holds it."""
        pipeline = self.pipeline
        budget = pipeline.kv_blocks if isinstance(pipeline, PagedPipeline) else None
        if budget is None:
            return
        spec = self.speculation
        drafts = spec.window.max_window if spec is not None else 0
        positions = len(run.prompt) + run.params.budget + drafts
        blocks = request_blocks(positions, self.context_size)
        if blocks > budget:
            raise ContextLengthError(positions, self.context_size, pool_tokens=budget * KV_BLOCK)
        await ticket.take_blocks(blocks, budget)

    async def tokenize(self, work: Callable[[], T]) -> T:
        """``work()`` (rendering, tokenizing or detokenizing a request's text) in a worker
        thread, at most :data:`MAX_TOKENIZING` at once: never on the event loop, where a
        large prompt would stall every connection and the mesh's heartbeats."""
        return await trio.to_thread.run_sync(work, limiter=self._tokenizing)

    def finish(self, run: GenerationRun) -> None:
        """Free the slot of ``run``; idempotent (:meth:`stream` calls it at its end)."""
        ticket = self._tickets.pop(run.request_id, None)
        if ticket is not None:
            ticket.release()

    @property
    def open_runs(self) -> int:
        """Runs started and not yet finished (each holds a slot)."""
        return len(self._tickets)

    def _new_run(self, prompt: list[int], request: GenerationParams) -> GenerationRun:
        """A run for ``prompt``, with the budget clamped to the context."""
        room = self.context_size - len(prompt)
        if room < 1:
            raise ContextLengthError(len(prompt), self.context_size)
        params = request.within(room, self.eos_token_ids)
        state = GenerationState(params, self.codec.detokenizer())
        return GenerationRun(self.scheduler.new_request_id(), prompt, params, state)

    # -- generation -----------------------------------------------------------------

    async def stream(self, run: GenerationRun) -> AsyncGenerator[Delta, None]:
        """Run ``run`` (started by :meth:`start`) and yield its deltas; metrics are recorded
        as it goes and the run's slot is freed at the end.

        Raises ServiceUnavailableError when the mesh is loading, and PipelineError when a
        pass fails mid-generation.
        """
        try:
            pipeline = self._require_pipeline()
            self.metrics.in_flight.value += 1
            self.metrics.prompt_tokens.inc(len(run.prompt))
            counted = 0  # tokens of this run already in the metrics: they count as they come
            try:
                deltas = generate(
                    pipeline,
                    run,
                    speculation=self.speculation,
                    chunk_tokens=self.chunk_tokens,
                    on_pass=self._observe_pass,
                    replacement=self.next_pipeline,
                )
                async with aclosing(deltas):
                    async for delta in deltas:
                        counted = self._observe_progress(run, counted)
                        yield delta
            finally:
                self.metrics.in_flight.value -= 1
                self._observe_progress(run, counted)
                self._observe_run(run)
        finally:
            self.finish(run)

    async def complete(self, run: GenerationRun) -> list[Delta]:
        """Run to the end and return every delta (for non-streaming responses)."""
        async with aclosing(self.stream(run)) as deltas:
            return [delta async for delta in deltas]

    async def reply(self, run: GenerationRun, endpoint: str) -> list[Delta]:
        """:meth:`complete` for a route's non-streamed reply: counted in ``endpoint``'s
        requests, and a mesh that fails under it is a 503 (``ServiceUnavailableError``)."""
        outcome = "error"
        try:
            deltas = await self.complete(run)
            outcome = "ok"
            return deltas
        except PipelineError as exc:
            log.warning("request %s failed: %s", run.request_id, exc)
            raise ServiceUnavailableError(f"The mesh failed during generation: {exc}") from exc
        finally:
            self.metrics.requests.inc(endpoint=endpoint, outcome=outcome)

    def _observe_pass(self, pass_s: float, result: StepResult) -> None:
        self.metrics.stage_compute.observe(result.compute_s)
        self.metrics.wire.observe(max(0.0, pass_s - result.compute_s))
        for stage, seconds in enumerate(result.stage_compute_s or (result.compute_s,)):
            self.metrics.stage_seconds.inc(seconds, stage=str(stage))

    def _observe_progress(self, run: GenerationRun, counted: int) -> int:
        """Count the run's new tokens, and its first-token time once it has one (live
        figures for the console); returns the tokens counted so far."""
        produced = len(run.state.tokens)
        self.metrics.generation_tokens.inc(produced - counted)
        if counted == 0 and produced > 0 and (ttft := run.timings.ttft_s) is not None:
            self.metrics.ttft.observe(ttft)
        return produced

    def _observe_run(self, run: GenerationRun) -> None:
        produced = len(run.state.tokens)
        self.metrics.replays.inc(run.replays)
        self.metrics.prompt_cached_tokens.inc(run.cached_tokens)  # hook (issue 30)
        if (tpot := run.timings.tpot_s(produced)) is not None:
            self.metrics.tpot.observe(tpot)
        self.spec_total = self.spec_total.merge(run.spec)
        self.metrics.observe_speculation(run.strategy, run.spec, self.spec_total)


__all__ = ["PipelineError", "ServeService", "TextCodec"]
