"""The compiled half of :mod:`.moe_step`: a mixture-of-experts layer's feed-forward for one
decode row, from the attention's output to the next layer's normed input, in one call.

:func:`moe_step` runs, in this order and by the same compiled functions as the Python path
(so the same bits): the residual add and the feed-forward norm (:func:`.norms.add_rms_norm`),
the router's product (posted to the kernel pool, :func:`.pool_words._post`, or run alone),
its bias, the exponentials of the logits less their maximum (NumPy's ``exp``, in numba's
object mode: the compiled ``exp`` rounds otherwise, see :mod:`.experts_route`), the routing
(:func:`.experts_route.route_group`), the chosen experts (:func:`.experts_kernels.fill_block`
and the experts' job, posted or alone), their weighted sums (:func:`.experts_kernels.sums`)
and the next residual add and norm. A helper that slept is woken in object mode too (it
waits on a ``threading.Event``), as :meth:`.pool.KernelPool.run` wakes it. The call holds
the GIL (object mode needs it, and numba warns of ``nogil`` beside it): ~2 ms a layer of
Qwen3-30B-A3B's shape, less than the interpreter's own switch interval (5 ms).

Imported (numba configured first) by :func:`.moe_step._compiled`.
"""

from __future__ import annotations

import numpy as np
from numba import objmode

from meshnode.engine.cpu import experts_kernels, experts_route, matrix, norms, pool_words
from meshnode.engine.cpu.simd import entry

__all__ = ["f32_words", "i64_words", "moe_step"]

_MAX_GEN = pool_words._MAX_GEN
_NO_WEIGHT = np.zeros(0, np.float32)


def wake(woken: int) -> None:
    """Wake the helpers ``woken`` names (bit ``who`` set: helper ``who``) of the process's
    kernel pool, the one the call posted to (:meth:`.pool.KernelPool.wake`)."""
    matrix._pool().wake(woken)


@entry()
def _product(st, gen, shared, fn, a, b, c, x, out, scratch, rows, patience):  # type: ignore[no-untyped-def]
    # one job: posted to the pool as KernelPool._post posts it (job gen + 1), or, not
    # shared or declined (a helper still holds a chunk of the job before the last), run
    # alone by the same chunk function. Returns bits: 1 posted, 2 a sleeping helper woken,
    # 4 declined.
    if shared:
        g = gen % _MAX_GEN + 1
        woken = pool_words._post(st, fn, g, a, b, c, x, out, scratch, rows, patience)
        if woken >= 0:
            if woken != 0:
                with objmode():
                    wake(woken)
                pool_words._work(st, patience)
                return 3
            return 1
        pool_words.run_chunks(fn, a, b, c, x, out, rows)
        return 4
    pool_words.run_chunks(fn, a, b, c, x, out, rows)
    return 0


def f32_words(width: int, n: int, k: int) -> int:
    """The float32 buffer :func:`moe_step` takes, in words, for rows of ``width`` values,
    ``n`` experts and ``k`` a row: the sums and norms (five rows), the logits, their
    shifts and exponentials, the k weights and the k experts' outputs."""
    return 5 * width + 3 * n + k + k * width


def i64_words(n: int, k: int) -> int:
    """The int64 buffer :func:`moe_step` takes, in words: the counts, picks, chosen
    experts, their starts, the order and the experts' call block."""
    return 3 + k + n + n + 1 + k + experts_kernels.BLOCK_WORDS


@entry()
def moe_step(  # type: ignore[no-untyped-def]
    x, h, ffn_norm, next_norm, eps,
    st, gen, shared, scratch,
    router_fn, ra, rb, rc, router_bias, router_rows, router_patience,
    ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit,
    experts_fn, tasks, empty, experts_rows, experts_patience, no_out,
    topk_softmax, norm_topk, k, f32, i64,
):  # fmt: skip
    """The feed-forward of one decode row ``x`` ``[1, E]`` (the residual) after its
    attention output ``h`` ``[1, E]``: the layer's output into words ``3 E .. 4 E`` of
    ``f32`` and it through ``next_norm`` into ``4 E .. 5 E`` (empty: not normed).
    ``st``, ``gen``, ``scratch``: the pool's words, last job number and scratch
    (``shared``: post the two products, else run them alone); the router's chunk
    function, parts, bias (empty: none), chunk rows and patience; the experts' stacks and
    activation (as :func:`.experts_kernels.fill_block` takes them), chunk function, dummy
    parts, chunk rows and patience; the routing rule; the buffers (:func:`f32_words`,
    :func:`i64_words`: every array of the call, which the pool keeps while a helper may
    read them), whose first three int64 words get the jobs posted, those that woke a
    helper and those declined (then run alone)."""
    width, n = x.shape[1], ra.shape[0] + rb.shape[0] + rc.shape[0]
    total, normed = f32[:width].reshape(1, width), f32[width : 2 * width].reshape(1, width)
    ffn = f32[2 * width : 3 * width].reshape(1, width)
    out_total = f32[3 * width : 4 * width].reshape(1, width)
    out_normed = f32[4 * width : 5 * width].reshape(1, width)
    if next_norm.shape[0] == 0:
        out_normed = f32[:0].reshape(0, 0)
    at = 5 * width
    logits = f32[at : at + n].reshape(1, n)
    shifted = f32[at + n : at + 2 * n].reshape(1, n)
    e = f32[at + 2 * n : at + 3 * n].reshape(1, n)
    weights = f32[at + 3 * n : at + 3 * n + k].reshape(1, k)
    at += 3 * n + k
    ys = f32[at : at + k * width].reshape(k, width)
    posts = i64[:3]
    picks = i64[3 : 3 + k].reshape(1, k)
    chosen = i64[3 + k : 3 + k + n]
    starts = i64[3 + k + n : 4 + k + 2 * n]
    order = i64[4 + k + 2 * n : 4 + 2 * k + 2 * n]
    block = i64[4 + 2 * k + 2 * n : 4 + 2 * k + 2 * n + experts_kernels.BLOCK_WORDS]
    norms.add_rms_norm(x, h, _NO_WEIGHT, ffn_norm, eps, total, normed)
    flat = normed.reshape(-1)
    got = _product(
        st, gen, shared, router_fn, ra, rb, rc, flat, logits, scratch, router_rows, router_patience
    )
    posts[0], posts[1], posts[2] = got & 1, got >> 1 & 1, got >> 2
    if router_bias.shape[0]:
        for i in range(n):
            logits[0, i] = logits[0, i] + router_bias[i]
    most = logits[0, 0]
    for i in range(1, n):
        most = max(most, logits[0, i])
    for i in range(n):
        shifted[0, i] = logits[0, i] - most
    with objmode():
        np.exp(shifted, out=e)
    m = experts_route.route_group(
        logits, e, topk_softmax, norm_topk, picks, weights, chosen, starts, order
    )
    experts_kernels.fill_block(
        block, ga, gb, gc, da, db, dc, gbias, dbias, kind, alpha, limit, normed,
        chosen[:m], starts[: m + 1], order, k, ys,
    )  # fmt: skip
    job = tasks[: m * experts_kernels.TASK_ROWS]
    gen = gen % _MAX_GEN + 1 if posts[0] else gen
    got = _product(
        st, gen, shared, experts_fn, job, empty, empty, block, no_out, scratch, experts_rows,
        experts_patience,
    )  # fmt: skip
    posts[0] += got & 1
    posts[1] += got >> 1 & 1
    posts[2] += got >> 2
    experts_kernels.sums(ys, picks, weights, ffn)
    norms.add_rms_norm(total, ffn, _NO_WEIGHT, next_norm, eps, out_total, out_normed)
