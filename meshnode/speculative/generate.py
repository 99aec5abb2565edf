"""Single-node speculative generation: the ladder the pipeline's generation loop mirrors.

``prefill`` → repeat { ``propose`` → ``verify`` (one forward of k + 1 rows) → ``accept``
→ commit } until EOS or the token budget. Rollback is positional: the verify forward
starts at the position of the last committed token, and ``forward`` truncates the cache
there first; after acceptance the cache is cut to the committed tokens so that its length
always equals ``len(history) - 1`` (the last committed token is the next step's input).

Greedy runs are token-for-token identical to plain greedy decoding; sampled runs follow
the target's distribution (``meshnode.speculative.acceptance``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import Stage
from meshnode.engine.sampling import CounterRandom, SamplingParams, random_seed
from meshnode.speculative.acceptance import verify
from meshnode.speculative.proposer import Proposal, Proposer
from meshnode.speculative.scorer import forward_rows
from meshnode.speculative.telemetry import SpecStats
from meshnode.speculative.window import StepCosts, Window, WindowPolicy


@dataclass(slots=True)
class SpecRun:
    """One sequence being generated: its history, cache, window and counters."""

    stage: Stage
    params: SamplingParams
    cache: KVCache
    history: list[int]
    prompt_len: int
    random: CounterRandom
    window: Window
    capacity: int
    stats: SpecStats = field(default_factory=SpecStats)

    def cache_room(self) -> int:
        """Drafts that still fit: a verify writes positions ``len(history) - 1`` onward."""
        return self.capacity - len(self.history)

    @property
    def generated(self) -> list[int]:
        """The committed tokens after the prompt."""
        return self.history[self.prompt_len :]


def choose(
    run: SpecRun, logits: npt.NDArray[np.float32], proposal: Proposal
) -> tuple[int, list[int]]:
    """Apply the acceptance rule for the request's mode to the verify pass's logits (the
    same rule, :func:`~meshnode.speculative.acceptance.verify`, as a pipeline's last stage).
    The first row decides the token at position ``len(history)``."""
    generated = [*run.generated, *proposal.tokens]
    first, position = len(run.generated), len(run.history)
    return verify(
        logits, proposal.tokens, run.params, generated, first, proposal.probs, run.random, position
    )


def prefill(
    stage: Stage,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    capacity: int,
    window: WindowPolicy,
    costs: StepCosts | None = None,
) -> SpecRun:
    """Run the prompt and commit its first token (``costs``: shared step costs, if any).
    Draws come from ``params.seed`` (a random seed when it is ``None``)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    cache: KVCache = stage.new_cache(capacity)
    logits = forward_rows(stage, prompt, 0, cache, rows=1)
    run = SpecRun(
        stage=stage,
        params=params,
        cache=cache,
        history=list(prompt),
        prompt_len=len(prompt),
        random=CounterRandom(random_seed() if params.seed is None else params.seed),
        window=Window(window, costs),
        capacity=capacity,
    )
    _, tokens = choose(run, logits, Proposal(()))
    run.history += tokens
    return run


def verify_step(
    run: SpecRun,
    proposer: Proposer,
    max_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[int]:
    """One propose → verify → accept round; returns the tokens it committed (≥ 1).

    ``max_tokens`` bounds the tokens this step may commit (drafts + 1).
    """
    history = run.history
    began = clock()  # a step's cost includes proposing: a draft model's steps are not free
    room = min(run.window.size, max_tokens - 1, run.cache_room())
    proposal = proposer.propose(history, room) if room > 0 else Proposal(())
    proposal = _clip(proposal, room)
    start = len(history) - 1  # the last committed token's K/V is not in the cache yet
    logits = forward_rows(
        run.stage, [history[-1], *proposal.tokens], start, run.cache, rows=len(proposal) + 1
    )
    accepted, tokens = choose(run, logits, proposal)
    seconds = clock() - began
    # Rejected drafts' K/V stay in the cache until the next forward overwrites them;
    # cutting here keeps cache length == committed K/V-bearing tokens at every boundary.
    run.cache.truncate(start + 1 + accepted)
    history += tokens
    run.stats.record(len(proposal), accepted, seconds)
    proposer.on_result(len(proposal), accepted, seconds=seconds)
    run.window.update(len(proposal), accepted, seconds)
    return tokens


def speculative_generate(
    stage: Stage,
    prompt: Sequence[int],
    params: SamplingParams,
    proposer: Proposer,
    *,
    max_new_tokens: int,
    window: WindowPolicy,
    eos_ids: Sequence[int] = (),
    clock: Callable[[], float] = time.perf_counter,
    costs: StepCosts | None = None,
) -> SpecRun:
    """Generate up to ``max_new_tokens`` after ``prompt``, stopping after an EOS id.

    Returns the finished run (``run.generated`` holds the tokens, ``run.stats`` the
    speculation counters). The cache is sized for the prompt, the budget and one window.
    """
    capacity = len(prompt) + max_new_tokens + window.max_window + 1
    run = prefill(stage, prompt, params, capacity=capacity, window=window, costs=costs)
    stop = set(eos_ids)
    tokens = run.generated
    while not stop.intersection(tokens) and len(run.generated) < max_new_tokens:
        tokens = verify_step(run, proposer, max_new_tokens - len(run.generated), clock)
    _trim_after_stop(run, stop)
    return run


def _trim_after_stop(run: SpecRun, stop: set[int]) -> None:
    """Drop what a verify pass committed after the first EOS."""
    generated = run.generated
    end = next((i + 1 for i, t in enumerate(generated) if t in stop), len(generated))
    del run.history[run.prompt_len + end :]


def _clip(proposal: Proposal, room: int) -> Proposal:
    if len(proposal) <= room:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:room]
    return Proposal(proposal.tokens[:room], probs)
