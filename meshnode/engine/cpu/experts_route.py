"""The compiled routing of :mod:`.experts`: softmax, top-k, weights and the rows grouped by
expert, in one call per layer.

:func:`meshnode.engine.moe.route` and :func:`.experts.group` in NumPy cost a decode step
about twenty array calls per layer (``benchmarks/moe.py``: ``route`` and ``group``).
:func:`route_group` does their work in one compiled call with the same bits: the
exponentials are NumPy's (``np.exp`` of ``logits - max``, computed before the call: the
compiled ``exp`` rounds otherwise), and every sum is NumPy's pairwise summation
(:func:`_pairwise_sum`, ``add.reduce`` over a contiguous row), so the weights are
``route``'s to the bit; the top k are the largest first, equal scores in index order (a
stable sort's order); the grouping is :func:`.experts.group`'s (experts ascending, each
one's entries in flat index order).

Imported (numba configured first) by :func:`.experts.route`.
"""

from __future__ import annotations

import numpy as np

from meshnode.engine.cpu.simd import entry, inner

__all__ = ["PAIRWISE_BLOCK", "route_group"]

# NumPy's PW_BLOCKSIZE: a run of at most this many values is summed in eight lanes, a
# longer one split in two (numpy/_core/src/umath/loops_utils.h.src, pairwise_sum).
PAIRWISE_BLOCK = 128
_STACK = 64  # pending halves of a pairwise sum: its depth is log2(n / 128) + 1 at most


@inner
def _block_sum(a, lo, n):  # type: ignore[no-untyped-def]
    """``a[lo : lo + n]``'s sum as NumPy's ``pairwise_sum`` adds a run of at most
    :data:`PAIRWISE_BLOCK` float32 values: under 8 one after another from zero, else in
    eight lanes, the lanes in a tree, then the remainder."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res = res + a[lo + i]
        return res
    r = np.empty(8, np.float32)
    for j in range(8):
        r[j] = a[lo + j]
    i = 8
    while i < n - n % 8:
        for j in range(8):
            r[j] = r[j] + a[lo + i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res = res + a[lo + i]
        i += 1
    return res


@inner
def _pairwise_sum(a):  # type: ignore[no-untyped-def]
    """The sum of the float32 values ``a`` as ``np.add.reduce`` gives it for a contiguous
    row: runs longer than :data:`PAIRWISE_BLOCK` split at ``n / 2`` rounded down to a
    multiple of 8, each half summed so, the halves added (NumPy's recursion, here with a
    stack: ``lo``, ``n`` and how far each pending run got)."""
    n = a.shape[0]
    if n <= PAIRWISE_BLOCK:
        return _block_sum(a, 0, n)
    los = np.empty(_STACK, np.int64)
    ns = np.empty(_STACK, np.int64)
    done = np.empty(_STACK, np.int64)  # 0: neither half summed, 1: the left, 2: both
    vals = np.empty(_STACK, np.float32)
    top, nv = 0, 0
    los[0], ns[0], done[0] = 0, n, 0
    while top >= 0:
        lo, m = los[top], ns[top]
        if m <= PAIRWISE_BLOCK:
            vals[nv] = _block_sum(a, lo, m)
            nv += 1
            top -= 1
            continue
        half = m // 2 - (m // 2) % 8
        if done[top] == 2:
            vals[nv - 2] = vals[nv - 2] + vals[nv - 1]
            nv -= 1
            top -= 1
            continue
        first = done[top] == 0
        done[top] += 1
        top += 1
        los[top] = lo if first else lo + half
        ns[top] = half if first else m - half
        done[top] = 0
    return vals[0]


@inner
def _top_k(scores, taken, out):  # type: ignore[no-untyped-def]
    """``out`` ``[k]``: the indices of the k largest ``scores``, largest first, equal
    scores in index order (``argsort(-scores, kind="stable")[:k]``)."""
    taken[:] = False
    for s in range(out.shape[0]):
        best = -1
        for j in range(scores.shape[0]):
            if not taken[j] and (best < 0 or scores[j] > scores[best]):
                best = j
        taken[best] = True
        out[s] = best


@entry(nogil=True)
def route_group(logits, e, topk_softmax, norm, picks, weights, chosen, starts, order):  # type: ignore[no-untyped-def]
    """Each row's experts ``picks`` ``[r, k]`` and weights ``[r, k]`` from its router
    ``logits`` ``[r, n]`` and ``e = exp(logits - row max)`` ``[r, n]`` (NumPy's), then the
    grouping; returns m, the experts chosen (``chosen[:m]`` ascending, their entries from
    ``starts[i]`` to ``starts[i + 1]`` of ``order`` ``[r k]``, flat indices ``row k +
    slot``).

    ``topk_softmax`` (gpt-oss): the k largest logits, softmax over them (their ``e`` over
    its sum: the largest logit is the row's maximum). Else softmax over all ``n``, the k
    largest probabilities, divided by their sum when ``norm``."""
    rows, n = logits.shape
    k = picks.shape[1]
    probs = np.empty(n, np.float32)
    taken = np.empty(n, np.bool_)
    sel = np.empty(k, np.float32)
    for r in range(rows):
        if topk_softmax:
            _top_k(logits[r], taken, picks[r])
            for s in range(k):
                sel[s] = e[r, picks[r, s]]
            total = _pairwise_sum(sel)
            for s in range(k):
                weights[r, s] = sel[s] / total
            continue
        total = _pairwise_sum(e[r])
        for j in range(n):
            probs[j] = e[r, j] / total
        _top_k(probs, taken, picks[r])
        for s in range(k):
            weights[r, s] = probs[picks[r, s]]
        if norm:
            total = _pairwise_sum(weights[r])
            for s in range(k):
                weights[r, s] = weights[r, s] / total
    counts = np.zeros(n + 1, np.int64)  # counts[x + 1]: entries of expert x
    for i in range(rows * k):
        counts[picks[i // k, i % k] + 1] += 1
    m = 0
    starts[0] = 0
    for x in range(n):
        if counts[x + 1]:
            chosen[m] = x
            starts[m + 1] = starts[m] + counts[x + 1]
            counts[x + 1] = starts[m]  # now where expert x's next entry goes
            m += 1
    for i in range(rows * k):
        x = picks[i // k, i % k]
        order[counts[x + 1]] = i
        counts[x + 1] += 1
    return m
