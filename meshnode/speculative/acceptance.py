"""Acceptance rules: which drafts the target keeps and which token it adds.

Both functions are pure: inputs are the target's probability rows for the k + 1 verified
positions (``[k + 1, V]``, already processed with the request's sampling parameters by
``meshnode.engine.sampling.logits_to_probs``; row ``i`` is the distribution of the token
after ``last, d_1 … d_i``), the k drafts and, when sampling, the drafts' own probabilities.
Each returns ``(accepted, tokens)``: ``tokens`` is ``drafts[:accepted]`` followed by one
token chosen by the target, so one verify pass always commits ``accepted + 1`` tokens.

Sampled verification draws from the request's counter-based generator
(:class:`~meshnode.engine.sampling.CounterRandom`) at each row's sequence position, with
the same draw (the token race) as plain sampling there: for deterministic drafts (n-gram,
MTP, greedy draft models) the committed tokens are exactly those plain sampling would have
drawn, so a seeded request gives the same text with speculation on or off, and after a
replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from meshnode.engine.sampling import (
    CounterRandom,
    Draw,
    SamplingParams,
    apply_penalties,
    logits_to_probs,
)

Rows = npt.NDArray[np.floating]


def _check(target: Rows, drafts: Sequence[int]) -> None:
    if target.ndim != 2 or target.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"target rows {target.shape} do not match {len(drafts)} drafts (need k + 1 rows)"
        )


def accept_greedy(target: Rows, drafts: Sequence[int]) -> tuple[int, list[int]]:
    """Greedy verification, exact with respect to plain greedy decoding.

    Rule: accept the longest prefix of drafts with ``d_i == argmax(target[i])``; the next
    token is ``argmax(target[j])`` at the first mismatch ``j`` — or, when every draft
    matched, the bonus ``argmax(target[k])``. ``argmax`` takes the lowest id on ties, as
    plain greedy decoding does.
    """
    _check(target, drafts)
    best = np.argmax(target, axis=-1)
    accepted = 0
    while accepted < len(drafts) and int(best[accepted]) == drafts[accepted]:
        accepted += 1
    return accepted, [*drafts[:accepted], int(best[accepted])]


def greedy_targets(
    logits: Rows, params: SamplingParams, generated: Sequence[int], first: int
) -> Rows:
    """Rows whose argmax is the greedy token at each verified position, for ``accept_greedy``.

    Row ``i`` must see the penalties a plain greedy step there would: those of
    ``generated[: first + i]`` (the generated tokens, then the drafts before it). Without
    penalties the logits themselves serve: a one-hot row per position (what
    ``logits_to_probs`` builds) has the same argmax, and skipping it saves a float64 copy of
    the whole vocabulary per row.
    """
    if not params.penalized:
        return logits
    rows = [apply_penalties(logits[i], params, generated[: first + i]) for i in range(len(logits))]
    return np.stack(rows)


def sample_row(row: Rows, random: CounterRandom, position: int, draw: Draw = Draw.TOKEN) -> int:
    """The token ``random``'s race of ``draw`` at ``position`` picks from a non-negative
    row (normalised or not): :meth:`~meshnode.engine.sampling.CounterRandom.pick`."""
    return random.pick(row, position, draw)


def accept_sampling(
    target: Rows,
    drafts: Sequence[int],
    draft_probs: Rows | None,
    random: CounterRandom,
    position: int,
) -> tuple[int, list[int]]:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Rule: for ``i = 0 … k-1`` with ``p = target[i]`` and ``q = draft_probs[i]`` (one-hot
    on ``d_i`` when ``draft_probs`` is ``None``, as for n-gram drafts), accept ``d_i``
    with probability ``min(1, p(d_i) / q(d_i))``. At the first rejection, sample the next
    token from ``normalize(max(p - q, 0))`` and stop. When all k are accepted, sample a
    bonus token from ``target[k]``. The committed tokens are then distributed exactly as
    if sampled from the target one at a time.

    Row ``i`` decides sequence position ``position + i``. For a one-hot ``q`` the rule is
    drawn as plain sampling draws: ``t`` is the token race's winner over ``p`` at that
    position, accept iff ``t == d_i``, else commit ``t``. That accepts with probability
    ``p(d_i)`` and, on rejection, ``t`` follows ``p`` without ``d_i``, which is the
    normalised residual: the same law, and the same token as without speculation. With a
    draft distribution the acceptance test takes the position's ``ACCEPT`` uniform and a
    rejection's token is the position's token race over the residual.
    """
    _check(target, drafts)
    if draft_probs is not None and draft_probs.shape[0] != len(drafts):
        raise ValueError(f"draft probs {draft_probs.shape} do not match {len(drafts)} drafts")
    for i, token in enumerate(drafts):
        p, here = target[i], position + i
        if draft_probs is None:
            pick = sample_row(p, random, here)
            if pick == token:
                continue
            return i, [*drafts[:i], pick]
        q_token = float(draft_probs[i, token])
        if q_token > 0 and random.uniform(here, Draw.ACCEPT) * q_token < float(p[token]):
            continue
        residual = _residual(p, token, draft_probs, i)
        return i, [*drafts[:i], sample_row(residual, random, here)]
    bonus = sample_row(target[-1], random, position + len(drafts))
    return len(drafts), [*drafts, bonus]


def _residual(p: Rows, token: int, draft_probs: Rows, i: int) -> Rows:
    """``max(p - q, 0)`` for row ``i``; falls back to ``p`` if that has no mass.

    The fallback only triggers when ``p == q`` up to rounding, where a rejection has
    probability ~0 and any draw from ``p`` is correct.
    """
    residual = np.maximum(p.astype(np.float64) - draft_probs[i], 0.0)
    return residual if residual.sum() > 0 else p


def verify(
    logits: Rows,
    drafts: Sequence[int],
    params: SamplingParams,
    generated: Sequence[int],
    first: int,
    draft_probs: Rows | None,
    random: CounterRandom,
    position: int,
) -> tuple[int, list[int]]:
    """The acceptance rule for the request's mode, over the ``k + 1`` rows of a verify pass.

    ``generated`` holds the generated tokens with the drafts from index ``first`` on: row
    ``i`` sees the penalties of ``generated[: first + i]``, exactly as a plain step at its
    position would. Greedy requests accept the drafts that equal the argmax
    (:func:`accept_greedy`); sampled ones follow :func:`accept_sampling`, with
    ``draft_probs`` ``[k, V]`` (``None``: deterministic drafts), drawing from ``random``
    with row 0 at sequence ``position`` (that of the first draft). Returns (accepted
    drafts, committed tokens). The last stage of a pipeline and the single-node driver
    both call this.
    """
    rows = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        return accept_greedy(greedy_targets(rows, params, generated, first), drafts)
    target = np.stack(
        [logits_to_probs(rows[i], params, generated[: first + i]) for i in range(len(drafts) + 1)]
    )
    probs = None if draft_probs is None else np.asarray(draft_probs, dtype=np.float64)
    return accept_sampling(target, drafts, probs, random, position)
