"""What the last stage commits for one frame: a sampled token, or a verify pass's verdict.

The last stage of a pipeline computes the logits rows a frame asks for (DESIGN §2) and
decides here, with no I/O:

- a prefill's or a decode's last row is sampled at the token's sequence position (the
  acceptance rule with no drafts: the target adds one token);
- a verify pass's ``k + 1`` rows go through :func:`~meshnode.speculative.acceptance.verify`
  (greedy or speculative sampling, by the request's mode);
- where the request asks, each committed token gets the model's own log-probability and
  its ``top`` alternatives, from the raw rows (before any grammar mask, as vLLM reports
  them: a masked row would report -inf, which JSON cannot carry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.engine.sampling import Sampler, token_logprobs
from meshnode.speculative.acceptance import Rows, verify

__all__ = ["Decision", "TopLogprobs", "decide"]

#: The log-probability of a committed token and its best alternatives (id, log-probability).
TopLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class Decision:
    """The tokens one frame commits: ``accepted`` drafts and then the target's token."""

    accepted: int = 0
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TopLogprobs, ...] | None = None  # one per token, when asked for


def decide(
    rows: Rows,
    sampler: Sampler,
    generated: Sequence[int],
    *,
    end_pos: int,
    prompt_len: int,
    drafts: Sequence[int] | None = None,
    draft_probs: Rows | None = None,
    raw: Rows | None = None,
    top: int | None = None,
) -> Decision:
    """The decision over ``rows`` (logits ``[r, V]`` on the host, masked by the request's
    grammar where it has one) of a frame that fills the sequence up to ``end_pos``.

    ``generated`` is the sequence's history after its prompt (``prompt_len`` tokens),
    drafts included. ``drafts=None`` samples the token at ``end_pos`` from the last row; a
    verify pass gives its drafts (the rows are ``[last, d_1 … d_k]``'s) and, for sampled
    drafts, their probabilities ``[k, V]``. ``top`` (None: no log-probabilities) reads
    ``raw``, the rows before the mask (``rows`` when None). A verify pass needs ``k + 1``
    rows for ``k`` drafts (a greedy one raises ``ValueError`` otherwise).
    """
    if drafts is None:
        # The token after the frame's rows sits at position end_pos.
        accepted, tokens = 0, [sampler.sample(rows[-1], generated, end_pos)]
    else:
        # Row i scores the token after last, d_1 … d_i; d_1 sits at end_pos - k.
        position = end_pos - len(drafts)
        accepted, tokens = verify(
            rows,
            drafts,
            sampler.params,
            generated,
            position - prompt_len,
            draft_probs,
            sampler.random,
            position,
        )
    logprobs = None
    if top is not None:
        unmasked = rows if raw is None else raw
        logprobs = tuple(token_logprobs(unmasked[i], t, top) for i, t in enumerate(tokens))
    return Decision(accepted, tuple(tokens), logprobs)
