"""Turning logits into the next token: penalties, temperature, truncation, seeded draws.

The order follows vLLM's sampler: penalties on the raw logits, then temperature, then
top-k, top-p and min-p truncation on the resulting distribution. Temperature 0 is greedy.
All of it runs on the host in float64 (one ``[V]`` row per step is cheap to copy).

Randomness is counter-based (:class:`CounterRandom`): the numbers that pick the token at
sequence position ``p`` are a pure function of (seed, ``p``), not the next output of a
generator whose state lives in one process. Whichever node runs the last stage, and
however often a request is replayed after a stage failure, a seeded request draws the
same numbers at the same positions.

The pick is an exponential race (:func:`race`, the Gumbel-max trick): every kept token
``i`` gets its own exponential ``E_i`` keyed on (seed, position, ``i``), and the token is
``argmin(E_i / p_i)``, distributed exactly as ``p``. Same numbers are not enough for the
same token: a replayed pass's logits come from a chunked prefill and differ from the
undisturbed decode's by float noise (~2e-5 on SmolLM2). Inverse-CDF sampling (one uniform
against a cumulative sum over the vocabulary in id order) turns that noise into another
token whenever the uniform falls near any boundary it shifts; the race only changes its
winner on a near-tie between the two best ``E_i / p_i``, as greedy does on a near-tie
between the two best logits.

:class:`SamplingParams` is the one record of a request's sampling settings: the API builds
it from the request body (its fields and defaults are generated from this record), the
wire carries it as ``meshnode_protocol.Sampling`` (converted field by field, generically),
and the last stage samples with it. Its defaults are OpenAI's (temperature 1), which are
also what the wire schema means by an omitted field; :data:`GREEDY` is temperature 0.
"""

from __future__ import annotations

import enum
import functools
import math
import secrets
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "GREEDY",
    "MAX_LOGIT_FACTOR",
    "MIN_LOGIT_DIVISOR",
    "CounterRandom",
    "Draw",
    "Sampler",
    "SamplingParams",
    "logits_to_probs",
    "race",
    "random_seed",
    "token_logprobs",
]


#: The smallest non-zero temperature and repetition penalty: the logits (float32, below
#: ~3.4e38) divided by either stay below float64's ~1.8e308, so none overflows to inf and the
#: sampler never meets NaN (1e-308 failed a request as a retryable error; issue 36).
MIN_LOGIT_DIVISOR = 1e-100
#: The largest temperature and repetition penalty, and the largest presence or frequency
#: penalty either way: a logit multiplied by one, or a penalty times a token's count in any
#: context, stays finite in float64 as well.
MAX_LOGIT_FACTOR = 1e100


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Neutral values switch a knob off.

    ``temperature`` 0 means greedy (1, the default, samples from the model's distribution
    as is); ``top_k`` 0 keeps every token; ``top_p`` 1 and ``min_p`` 0 keep every token;
    ``repetition_penalty`` 1 and the OpenAI-style ``presence_penalty``/``frequency_penalty``
    0 leave the logits alone. Integers given for float fields are stored as floats, and a
    ``seed`` is folded into ``[0, 2**64)`` (clients of llama.cpp send -1; every generator
    and the wire take unsigned 64-bit seeds). Raises ValueError for a value outside a
    knob's range, NaN included; a non-zero temperature, the repetition penalty and the
    other two penalties' sizes lie within :data:`MIN_LOGIT_DIVISOR` ..
    :data:`MAX_LOGIT_FACTOR`, so whatever a client or a peer sends, no logit becomes inf.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.type == "float" and isinstance(value, int):
                object.__setattr__(self, spec.name, float(value))
        if self.seed is not None:
            object.__setattr__(self, "seed", self.seed % 2**64)
        if self.temperature != 0 and not MIN_LOGIT_DIVISOR <= self.temperature <= MAX_LOGIT_FACTOR:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_LOGIT_DIVISOR:g}, "
                f"{MAX_LOGIT_FACTOR:g}], got {self.temperature!r}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not MIN_LOGIT_DIVISOR <= self.repetition_penalty <= MAX_LOGIT_FACTOR:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_LOGIT_DIVISOR:g}, {MAX_LOGIT_FACTOR:g}], "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_LOGIT_FACTOR <= getattr(self, name) <= MAX_LOGIT_FACTOR:
                raise ValueError(
                    f"{name} must be in [{-MAX_LOGIT_FACTOR:g}, {MAX_LOGIT_FACTOR:g}], "
                    f"got {getattr(self, name)!r}"
                )

    @property
    def greedy(self) -> bool:
        """True when the pick is the argmax."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when a penalty changes the logits (``apply_penalties`` is not a copy)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


#: Always the most likely token (after penalties): what ``meshnode generate`` does by default.
GREEDY = SamplingParams(temperature=0.0)


def apply_penalties(
    logits: np.ndarray,
    params: SamplingParams,
    history: Sequence[int],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Logits with the penalties for tokens in ``history`` applied, in float64: a new
    array, or ``out`` (``[V]`` float64, overwritten) when given.

    Repetition penalty as in CTRL / transformers: positive logits are divided by it,
    negative ones multiplied. Presence and frequency penalties as in OpenAI's API:
    ``logit - presence * [count > 0] - frequency * count``.
    """
    if out is None:
        out = np.array(logits, dtype=np.float64)
    else:
        np.copyto(out, np.asarray(logits), casting="unsafe")
    if not history:
        return out
    counts = Counter(history)
    ids = np.fromiter(counts, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        seen = out[ids]
        rp = params.repetition_penalty
        out[ids] = np.where(seen > 0, seen / rp, seen * rp)
    if params.presence_penalty or params.frequency_penalty:
        n = np.fromiter(counts.values(), dtype=np.float64)
        out[ids] -= params.presence_penalty + params.frequency_penalty * n
    return out


def _truncate(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Zero every token that top-k, top-p or min-p excludes (ties at a cut are kept)."""
    keep = np.ones(probs.shape, dtype=bool)
    if 0 < params.top_k < probs.size:
        kth = np.partition(probs, -params.top_k)[-params.top_k]
        keep &= probs >= kth
    if params.top_p < 1.0:
        keep &= _nucleus(probs, params.top_p)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    return np.where(keep, probs, 0.0)


# Ids the nucleus is looked for among when the first guess (below) holds too many: the
# most likely ones, four times as many at each try that falls short of top_p.
NUCLEUS_FIRST_TRY = 256


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids of the smallest prefix, most likely first (ties by id), whose mass reaches
    ``top_p``: a token stays if the mass before it is still short of top_p.

    Without sorting the vocabulary. The first guess is the ids of probability at least
    ``(1 - top_p) / V``: the others hold less than ``1 - top_p`` together, so these
    hold the nucleus (at temperature 0.7 a few hundred of SmolLM2's 49k ids); when they
    are too many, the ``k`` most likely ids (all ids tied with the ``k``-th included).
    Either way a set of ids at or above a threshold, sorted: its running sum is the
    whole order's, the same float64 additions in the same order. Once it reaches
    ``top_p``, every later id has at least that much mass before it: out."""
    keep = np.zeros(probs.shape, dtype=bool)
    ids = np.flatnonzero(probs >= (1.0 - top_p) / probs.size)
    k = NUCLEUS_FIRST_TRY
    while True:
        order = ids[np.argsort(-probs[ids], kind="stable")]  # ids ascending: ties by id
        cum = np.cumsum(probs[order])
        if (cum.size and cum[-1] >= top_p) or ids.size == probs.size:
            keep[order] = (cum - probs[order]) < top_p
            return keep
        if k < probs.size:
            kth = np.partition(probs, probs.size - k)[probs.size - k]
            ids = np.flatnonzero(probs >= kth)
        else:
            ids = np.arange(probs.size)
        k *= 4


def _truncates(params: SamplingParams, size: int) -> bool:
    """Whether :func:`_truncate` can zero any token (otherwise it returns its input)."""
    return 0 < params.top_k < size or params.top_p < 1.0 or params.min_p > 0


def logits_to_probs(
    logits: Any,
    params: SamplingParams,
    history: Sequence[int] = (),
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The distribution ``[V]`` (float64, sums to 1) the next token is drawn from: a new
    array, or ``out`` (``[V]`` float64, overwritten) when given and no truncation applies.

    After the one copy (the penalties'), every step works in place: the same IEEE
    operations on the same values as the expressions ``exp(x / t - max)``, ``p / sum(p)``
    written out, without a temporary vocabulary-sized array per operation (each costs
    fresh pages: about half the draw's time at 49k tokens).
    """
    x = apply_penalties(np.asarray(logits), params, history, out)
    if params.greedy:
        best = int(np.argmax(x))
        x.fill(0.0)
        x[best] = 1.0
        return x
    x /= params.temperature
    x -= x.max()
    np.exp(x, out=x)
    x /= x.sum()
    if _truncates(params, x.size):
        x = _truncate(x, params)
    x /= x.sum()
    return x


def random_seed() -> int:
    """A fresh seed for a request that gave none (chosen once, so a replay repeats it)."""
    return secrets.randbits(64)


class Draw(enum.IntEnum):
    """Which decision the numbers are for: independent draws at the same position."""

    TOKEN = 0  # the race that picks the token at a position (plain or after a rejection)
    ACCEPT = 1  # the acceptance test of a draft drawn from a distribution (draft model)
    DRAFT = 2  # a draft model's own sampled guess at a position


@dataclass(frozen=True, slots=True)
class CounterRandom:
    """Numbers keyed on (seed, position, draw): a counter-based generator.

    Philox4x64 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) is a
    keyed bijection of its counter, so the numbers at one counter need no state from
    earlier draws: the key is the request's seed and the counter (position, draw). Numpy's
    ``Philox`` implements it. A single uniform (:meth:`uniform`) is the first output of a
    generator set at counter ``(position, draw, 0, 0)``; a token race's exponentials
    (:meth:`exponentials`) are the stream from counter ``(0, position, draw, 1)``, one
    output per token id (the counter's first word counts blocks of four), which no
    uniform's counter and no other (position, draw)'s stream reaches.
    """

    seed: int

    def uniform(self, position: int, draw: Draw = Draw.TOKEN) -> float:
        """The uniform of ``draw`` at sequence ``position``, in ``[0, 1)``."""
        bits = np.random.Philox(key=self.seed, counter=(position, int(draw), 0, 0))
        # The top 53 bits of one 64-bit output: every double in [0, 1) of that spacing.
        return (int(bits.random_raw()) >> 11) * 2.0**-53

    def exponentials(
        self,
        position: int,
        count: int,
        draw: Draw = Draw.TOKEN,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Standard exponentials ``[count]`` of ``draw`` at ``position``, the i-th for token
        id ``i`` (a shorter call's are a prefix of a longer call's); written into ``out``
        (float64, at least ``count`` long: its first ``count`` entries are returned) when
        given."""
        bits = np.random.Philox(key=self.seed, counter=(0, position, int(draw), 1))
        # E = -log(u) with u = (k + 1) / 2**53 in (0, 1], k the top 53 bits of an output:
        # one log per token. Through int64, whose conversion to float is several times
        # faster than uint64's; k + 1 <= 2**53 is exact in a float.
        raw = bits.random_raw(count)
        raw >>= np.uint64(11)
        exps = np.empty(count) if out is None else out[:count]
        np.add(raw.view(np.int64), 1.0, out=exps)
        np.log(exps, out=exps)
        np.subtract(_LOG_2_53, exps, out=exps)
        return exps

    def pick(
        self,
        weights: Any,
        position: int,
        draw: Draw = Draw.TOKEN,
    ) -> int:
        """The token this generator's race of ``draw`` at ``position`` picks from
        ``weights`` (:func:`race` with :meth:`exponentials`), compiled: the exponentials
        of the ids that cannot win are never computed (:mod:`.cpu.draws`). Raises
        ValueError for weights with no mass."""
        row = np.ascontiguousarray(weights, dtype=np.float64).reshape(-1)
        pick = _draws().race_pick(row, *self._key, np.uint64(position), np.uint64(draw), _ONE)
        if pick < 0:
            raise ValueError("cannot sample from a distribution with no mass")
        return int(pick)

    @property
    def _key(self) -> tuple[np.uint64, np.uint64]:
        return np.uint64(self.seed % 2**64), np.uint64(self.seed >> 64)


_LOG_2_53 = 53 * math.log(2)
_ONE = np.uint64(1)


@functools.cache
def _draws() -> ModuleType:
    """The compiled race (:mod:`.cpu.draws`), imported (numba configured) on first use."""
    from meshnode.engine.cpu.matrix import lock_numba_cache

    lock_numba_cache()
    from meshnode.engine.cpu import draws

    return draws


def race(weights: Any, exponentials: Any, out: np.ndarray | None = None) -> int:
    """The exponential race: ``argmin(E_i / w_i)`` over the ids with weight ``w_i > 0``.

    With ``E_i`` independent standard exponentials, ``E_i / w_i`` is exponential with rate
    ``w_i`` and the smallest of them is ``i`` with probability ``w_i / sum(w)``: the race
    samples the normalised weights (no normalisation needed) and never picks a zero
    weight. It is the Gumbel-max trick, ``argmax(log w_i - log E_i)``. ``exponentials``
    has one entry per id. Ties, of probability ~0, go to the lowest id. ``out``: a float64
    array at least as long as the weights for the times (a fresh one otherwise). Raises
    ValueError for weights with no mass.
    """
    row = np.asarray(weights, dtype=np.float64)
    kept = row > 0
    if not kept.any():
        raise ValueError("cannot sample from a distribution with no mass")
    exps = np.asarray(exponentials, dtype=np.float64)
    times = np.empty(row.shape) if out is None else out[: row.size].reshape(row.shape)
    with np.errstate(over="ignore"):  # E / (a tiny weight) is inf: that id never wins
        if kept.all():  # no truncation, no underflow: the same quotients, unmasked
            np.divide(exps, row, out=times)
        else:
            times.fill(np.inf)
            np.divide(exps, row, out=times, where=kept)
    best = int(np.argmin(times))
    # Every kept time infinite (infinite exponentials given): any kept id is as good.
    return best if kept[best] else int(np.flatnonzero(kept)[0])


class Sampler:
    """Draws tokens for one sequence from a :class:`CounterRandom` keyed on its seed (a
    random one, chosen here, when the parameters carry none)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.random = CounterRandom(random_seed() if params.seed is None else params.seed)
        self._next_position = 0

    def sample(self, logits: Any, history: Sequence[int] = (), position: int | None = None) -> int:
        """The token id at sequence ``position`` for ``logits`` ``[V]``, given the tokens in
        ``history`` (penalties). Without ``position``, the one after the last draw's (0
        first): positions count draws, so a loop that draws once per token may omit it.

        Greedy without penalties is the argmax of the row as it comes (no float64 copy:
        the conversion is exact, so the pick is the same); a seeded draw works in this
        thread's scratch arrays (:func:`_scratch`), not in fresh vocabulary-sized ones."""
        position = self._next_position if position is None else position
        self._next_position = position + 1
        row = np.asarray(logits)
        if self.params.greedy:
            if not self.params.penalized:
                return int(np.argmax(row))
            return int(np.argmax(apply_penalties(row, self.params, history)))
        probs = logits_to_probs(row, self.params, history, _scratch(row.size))
        return self.random.pick(probs, position)


_SCRATCH = threading.local()


def _scratch(size: int) -> np.ndarray:
    """A float64 array ``[size]`` of this thread, reused by every draw it makes for the
    probabilities. A sampler is driven by one thread at a time (the last stage's compute
    thread) and returns only the token."""
    probs: np.ndarray | None = getattr(_SCRATCH, "probs", None)
    if probs is None or probs.size != size:
        probs = _SCRATCH.probs = np.empty(size)
    return probs


def token_logprobs(
    logits: Any, token: int, top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of ``token`` and its ``top`` best (id, log-probability).

    From the raw logits ``[V]`` (before temperature and penalties), as OpenAI reports them.
    """
    row = np.asarray(logits, dtype=np.float64)
    shifted = row - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    best: list[tuple[int, float]] = []
    if top > 0:
        ids = np.argpartition(-logprobs, top - 1)[:top]
        ids = ids[np.argsort(-logprobs[ids], kind="stable")]
        best = [(int(i), float(logprobs[i])) for i in ids]
    return float(logprobs[token]), tuple(best)
