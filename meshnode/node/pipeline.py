"""The pipeline abstraction: one pass of one sequence through every stage of the model.

The generation loop on stage 0 sees the model as a :class:`Pipeline`: it sends a
:class:`StepFrame` (new tokens of one sequence at ``start_pos``) and gets back a
:class:`StepResult` (the tokens the last stage committed). Whether the layers run in this
process (``node.local.LocalPipeline``) or across the mesh (``node.remote.RemotePipeline``,
which forwards the same records as ``ActivationFrame``/``Prediction`` wire messages) is
invisible to it. This module is the bottom of ``meshnode.node``: records and the protocol,
built on nothing else of the package.

Theory of operation, per sequence (DESIGN §2):

- ``PREFILL`` frames carry prompt chunks; only the ``final`` chunk asks for a token.
- ``DECODE`` frames carry the one token committed last; the result is the next token.
- ``VERIFY`` frames carry ``[last, d1 … dk]``; the last stage applies the acceptance rule
  and returns ``accepted`` drafts followed by its own next token.
- Every stage truncates the sequence's KV cache to ``start_pos`` before computing, so a
  rejected draft needs no message: the next frame simply starts earlier.
- ``release(request_id)`` frees the sequence on every stage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, NewType, Protocol, TypeVar, runtime_checkable

from meshnode.errors import MeshnodeError

if TYPE_CHECKING:
    from meshnode.engine.sampling import SamplingParams

RequestId = NewType("RequestId", str)
T = TypeVar("T")

#: Live sequences per stage. On a hybrid model's stage each holds a preallocated KV cache
#: of ``context_size`` positions (SmolLM2-135M: ~46 KiB per position, so 8 x 2048 positions
#: is ~750 MiB), which is why the bound exists; a CPU or CUDA stage's share a smaller pool
#: of blocks (:func:`meshnode.node.prefix.pool_blocks`). The host's scheduler admits no
#: more than this at once, the planner reserves KV for this many (a stage with a pool: the
#: pool), and every stage of a run allows this many.
MAX_SEQUENCES_PER_STAGE = 8


class FrameKind(enum.StrEnum):
    """What a frame asks of the last stage."""

    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass(frozen=True, slots=True)
class StepFrame:
    """New tokens of one sequence, and what to do with them (see the module docstring).

    ``tokens`` always travels, on every stage: the first stage embeds them and the last
    stage keeps the sequence's token history (for penalties) from them. ``hidden`` is the
    activation ``[len(tokens), hidden_size]`` entering a non-first stage. ``draft_probs``
    (``[k, vocab]``) is the draft distribution of ``tokens[1:]`` for a verify frame, or
    ``None`` for a deterministic (one-hot) draft. ``top_logprobs`` asks the last stage for
    the chosen tokens' log-probabilities and that many alternatives (``None``: none).
    """

    request_id: RequestId
    kind: FrameKind
    start_pos: int
    tokens: tuple[int, ...]
    sampling: SamplingParams
    final: bool = True
    draft_probs: Any = None
    hidden: Any = None
    top_logprobs: int | None = None
    # Drafts wanted from the last stage's MTP module for the tokens after this frame's
    # (0: none); they come back in ``StepResult.drafts`` (``--speculative mtp``).
    mtp_drafts: int = 0
    # The grammar (llguidance's serialized form) the last stage enforces on the tokens it
    # chooses for this sequence (None: unconstrained). Read when the sequence is created,
    # so only the frame at start_pos 0 needs it (the wire carries it there only), with
    # the position of the first token it constrains (the prompt's length).
    grammar: str | None = None
    grammar_start: int = 0
    # A new sequence's first frame resuming from the stages' cached prefix of
    # ``start_pos`` tokens: the hash-chain key of its last block (meshnode.node.prefix).
    prefix_key: bytes | None = None
    # Where each later stage starts the sequence, and the key of the prefix it resumes
    # from there (None: none), in order (a prompt's frames; :func:`onward`). Empty: every
    # later stage starts where this one does, with ``prefix_key``.
    resume: tuple[tuple[int, bytes | None], ...] = ()

    def __post_init__(self) -> None:
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")
        if self.prefix_key is not None and (self.start_pos == 0 or len(self.prefix_key) != 16):
            raise ValueError("a frame resumes from a 16-byte prefix key, at start_pos > 0")
        if self.resume:
            self._check_resume()
        if not self.tokens:
            raise ValueError("a frame carries at least one token")
        if self.kind is FrameKind.DECODE and len(self.tokens) != 1:
            raise ValueError(f"a decode frame carries one token, got {len(self.tokens)}")
        if self.kind is FrameKind.VERIFY and len(self.tokens) < 2:
            raise ValueError("a verify frame carries the last token and at least one draft")
        if self.kind is not FrameKind.PREFILL and not self.final:
            raise ValueError(f"only prefill frames may be non-final, not {self.kind}")

    def _check_resume(self) -> None:
        """The rules of ``resume`` (the wire's ``resume_starts``, ``protocol/README.md``)."""
        starts = [start for start, _ in self.resume]
        if self.kind is not FrameKind.PREFILL:
            raise ValueError("only a prompt's (prefill) frames say where later stages start")
        if any(b < a for a, b in zip([self.start_pos, *starts], starts, strict=False)):
            raise ValueError("later stages start in order, none before this frame")
        if any(k is not None and (s == 0 or len(k) != 16) for s, k in self.resume):
            raise ValueError("a later stage resumes from a 16-byte prefix key, at a start > 0")
        if self.final and starts[-1] >= self.end_pos:
            raise ValueError("a final frame reaches every stage: each starts before its end")

    @property
    def drafts(self) -> tuple[int, ...]:
        """The draft tokens of a verify frame (empty otherwise)."""
        return self.tokens[1:] if self.kind is FrameKind.VERIFY else ()

    @property
    def end_pos(self) -> int:
        """The cache length after this frame: ``start_pos + len(tokens)``."""
        return self.start_pos + len(self.tokens)


def onward(frame: StepFrame, hidden: Any) -> tuple[StepFrame, Any] | None:
    """What the stage after ``frame``'s goes on with: its own frame and its rows of
    ``hidden`` (this stage's output, rows first), or None when the frame ends before the
    next stage starts (a non-final prompt piece that stage resumes past, issue 30). The
    next stage starts at ``frame.resume``'s first entry, with its key, and keeps the rest;
    without entries it starts where this one did (``hidden`` as it is)."""
    if not frame.resume:
        return frame, hidden
    (start, key), rest = frame.resume[0], frame.resume[1:]
    if start >= frame.end_pos:
        return None
    cut = start - frame.start_pos
    next_frame = replace(
        frame, start_pos=start, tokens=frame.tokens[cut:], prefix_key=key, resume=rest
    )
    return next_frame, hidden[cut:]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of a chosen token and the top alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the last stage returns for one frame (``Prediction`` on the wire).

    ``tokens`` is ``accepted`` drafts followed by the target's own next token, empty for a
    non-final prefill chunk. ``logprobs`` parallels ``tokens`` when asked for.
    ``compute_s`` is the compute time summed over the stages, so that the driver can tell
    compute from wire time; ``stage_compute_s`` splits it by stage, in order (empty where a
    pipeline does not measure its stages one by one).
    """

    request_id: RequestId
    accepted: int = 0
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    compute_s: float = 0.0
    stage_compute_s: tuple[float, ...] = ()
    # The MTP module's drafts of the tokens after ``tokens`` (when the frame asked for them),
    # to be verified in the next window.
    drafts: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class PipelineError(MeshnodeError):
    """A pipeline pass failed (a stage died, a sequence limit was hit, ...)."""


class StageLostError(PipelineError):
    """A stage of the pipeline was lost (its connection dropped, its heartbeats stopped, a
    pass missed its deadline, or it no longer holds the run): every pass in flight fails,
    and so does every later one. The pipeline is dead, not the request: the generation
    loop replays the request on the pipeline the coordinator brings up next.

    ``node`` is the stage's node when it is known (``None``: the coordinator finds out);
    ``left``: that node said goodbye (a clean leave, not a failure: neither blamed nor kept
    out of the next plan).
    """

    def __init__(self, reason: str, *, node: str | None = None, left: bool = False) -> None:
        super().__init__(reason)
        self.node = node
        self.left = left


class Pipeline(Protocol):
    """The whole model, as the generation loop sees it. Implementations are async-safe:
    any number of tasks may call ``run`` for different sequences at once."""

    @property
    def context_size(self) -> int:
        """Positions each sequence may use (prompt and completion together)."""
        ...

    async def run(self, frame: StepFrame) -> StepResult:
        """One pass of ``frame`` through every stage. Raises :class:`PipelineError`."""
        ...

    async def release(self, request_id: RequestId) -> None:
        """Free the sequence's KV on every stage. Idempotent; never raises for unknown ids."""
        ...


@runtime_checkable
class PagedPipeline(Pipeline, Protocol):
    """A pipeline whose stages may keep pools of KV blocks (issue 30): the host admits
    requests by the blocks they may write (:meth:`meshnode.serve.scheduler.Ticket.take_blocks`)."""

    @property
    def kv_blocks(self) -> int | None:
        """Blocks all sequences together may hold on the smallest pool of a stage (None:
        no stage keeps one; :func:`meshnode.node.prefix.pipeline_blocks`)."""
        ...


class QueuedPass(Protocol):
    """A pass put in line before its caller waits for it (:meth:`QueuingPipeline.queue`)."""

    async def result(self) -> StepResult:
        """Wait for the pass (as :meth:`Pipeline.run` does). Raises :class:`PipelineError`."""
        ...

    def cancel(self) -> None:
        """Take the pass back if it has not started (its result is dropped otherwise)."""
        ...


@runtime_checkable
class QueuingPipeline(Pipeline, Protocol):
    """A pipeline whose passes can be put in line ahead of time: the generation loop
    queues a sequence's next decode frame as soon as it has the token, before it hands
    the token to its client, so that a step never waits for one client's I/O and a
    client's I/O overlaps the next forward."""

    def queue(self, frame: StepFrame) -> QueuedPass:
        """Put ``frame`` in line for the next step now; :meth:`QueuedPass.result` waits."""
        ...


@dataclass(eq=False, slots=True)
class Slot(Generic[T]):
    """One frame waiting for a step; the step function fills ``output`` or ``error``."""

    frame: StepFrame
    output: T | None = None
    error: MeshnodeError | None = None  # raised in the task that submitted the frame
    done: bool = False
    # The sequence's loop sends the frame after this one's output, if it goes on: a frame
    # put in line ahead (:meth:`Batcher.enqueue`), or a prediction such a frame claimed.
    follows: bool = False
    # Of a prediction (running ahead): how many predictions nobody had claimed yet it
    # follows (0: it follows a frame its loop sent). -1: a frame a loop sent.
    unclaimed: int = -1
