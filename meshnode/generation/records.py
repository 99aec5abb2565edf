"""The records of one request's run: what it asks (speculation), what it measured
(timings), and where it stands (:class:`GenerationRun`, readable while the driver runs it
and after), and the frames the driver and the replay send for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame, StepResult
from meshnode.speculative.telemetry import SpecStats
from meshnode.speculative.window import StepCosts, WindowPolicy

if TYPE_CHECKING:
    from meshnode.engine.sampling import SamplingParams
    from meshnode.speculative.proposer import Proposer

#: Prompt tokens per prefill frame. Small enough that a long prompt yields the pipeline
#: to other sequences every few hundred milliseconds on a CPU and that a chunk's
#: activations (256 x hidden x 2 bytes, ~2 MiB at hidden 4096) stay far below the wire
#: protocol's frame limit; large enough that per-frame overhead stays negligible.
DEFAULT_PREFILL_CHUNK_TOKENS = 256


#: Called after each pipeline pass with its wall seconds and its result (which carries the
#: compute seconds, in all and by stage).
PassObserver = Callable[[float, StepResult], None]


#: Builds one request's proposer from its sampling parameters and the context size (which
#: bounds a draft model's KV cache); ``None`` means this request does not speculate.
ProposerFactory = Callable[["SamplingParams", int], "Proposer | None"]


@dataclass(frozen=True, slots=True)
class Speculation:
    """How a request speculates: a fresh proposer per request and a window policy.

    ``strategy`` names it in telemetry. ``threaded`` runs ``propose`` in a worker thread:
    a model-based proposer computes forward passes, which must not block the event loop
    (an n-gram lookup is cheaper than the thread hop). ``costs`` are the node's measured
    step costs, shared by its requests, from which adaptive windows are sized
    (:mod:`meshnode.speculative.window`).
    """

    make_proposer: ProposerFactory
    window: WindowPolicy = field(default_factory=WindowPolicy)
    strategy: str = "custom"
    threaded: bool = False
    costs: StepCosts = field(default_factory=StepCosts)

    @classmethod
    def of(
        cls,
        proposer: Proposer,
        window: WindowPolicy,
        *,
        strategy: str = "custom",
        costs: StepCosts | None = None,
    ) -> Speculation:
        """Speculation with this one ``proposer``: for a single request (tests, benchmarks)."""

        def make(params: SamplingParams, capacity: int) -> Proposer:
            return proposer

        return cls(make, window, strategy=strategy, costs=StepCosts() if costs is None else costs)


@dataclass(slots=True)
class GenerationTimings:
    """Wall-clock marks of one request, from the trio clock (seconds)."""

    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    compute_s: float = 0.0
    passes: int = 0
    pass_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return None if self.first_token is None else self.first_token - self.started

    def tpot_s(self, completion_tokens: int) -> float | None:
        """Mean time per completion token after the first (``None`` if undefined)."""
        if self.first_token is None or self.finished is None or completion_tokens < 2:
            return None
        return (self.finished - self.first_token) / (completion_tokens - 1)


@dataclass(slots=True)
class GenerationRun:
    """The state of one request's driver, readable while it runs and after."""

    request_id: RequestId
    prompt: list[int]
    params: GenerationParams
    state: GenerationState
    spec: SpecStats = field(default_factory=SpecStats)
    timings: GenerationTimings = field(default_factory=GenerationTimings)
    on_pass: PassObserver | None = None
    strategy: str = "off"
    # MTP: drafts each frame asks of the last stage, and the latest ones it sent back with
    # the history length they follow (handed to the MtpProposer before it proposes).
    mtp_drafts: int = 0
    offered: tuple[int, tuple[int, ...]] = (0, ())
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    refolds: int = 0  # frames that started behind a snapshot ring: history prefilled again
    replays: int = 0  # pipelines lost under this request and replaced (module docstring)
    cached_tokens: int = 0  # prompt tokens resumed from the stages' prefix cache
    replay_cached_tokens: int = 0  # ... by its replays (the stages kept them, issue 30)

    @property
    def history(self) -> list[int]:
        """Prompt followed by the committed tokens."""
        return self.prompt + self.state.tokens


def frame_of(
    run: GenerationRun,
    kind: FrameKind,
    start_pos: int,
    tokens: Sequence[int],
    *,
    final: bool = True,
    probs: object = None,
) -> StepFrame:
    """The frame of ``run`` that carries ``tokens`` from ``start_pos``."""
    return StepFrame(
        request_id=run.request_id,
        kind=kind,
        start_pos=start_pos,
        tokens=tuple(tokens),
        sampling=run.params.sampling,
        final=final,
        draft_probs=probs,
        top_logprobs=run.params.top_logprobs,
        mtp_drafts=run.mtp_drafts,
        grammar=run.params.grammar,
        grammar_start=len(run.prompt),
    )
