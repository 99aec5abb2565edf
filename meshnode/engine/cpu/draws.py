"""The exponential race of :mod:`meshnode.engine.sampling`, compiled: the token a seeded
draw picks, without an exponential (a logarithm) or a random number per token.

:func:`meshnode.engine.sampling.race` gives every id ``i`` of weight ``w_i > 0`` the
standard exponential ``E_i`` keyed on (seed, position, draw, ``i``) and picks
``argmin(E_i / w_i)``. At a 49k vocabulary NumPy spends ~1 ms a row on it: Philox for
every id, a logarithm for every id, a quotient for every id. Here, in one pass over the
ids in order, with ``T`` the best time so far:

- Philox4x64 runs only for the blocks of four ids that hold a kept id (after top-p, a
  handful of blocks);
- ``E_i = -log(u_i)`` with ``u_i = (k_i + 1) / 2**53`` (``k_i``: the top 53 bits of the
  id's Philox output) can beat ``T`` only if ``E_i < T w_i``, and ``-log(u) >= 1 - u``,
  so an id with ``u_i <= 1 - T w_i`` (with a margin of :data:`_MARGIN` for the rounding
  of that bound) cannot win or tie: its logarithm is never taken. Only a few ids in a
  vocabulary pass the test (the best time falls fast), whatever the distribution.

Every id that could win or tie gets the exact time, as ``race`` computes it (the same
expression), and ties go to the lowest id: the pick is ``race``'s, up to the last bit of
``log`` (libm's here, NumPy's vector one there). Philox here is checked against NumPy's
``Philox`` bit for bit (tests/engine/test_sampling.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types

from meshnode.engine.cpu.simd import entry, inner, intrinsic

__all__ = ["philox_block", "race_pick"]

# Philox4x64-10 (Salmon et al., SC 2011; Random123's constants, as NumPy's Philox uses)
_M0, _M1 = np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157)
_W0, _W1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)
_ROUNDS = 10
_LOG_2_53 = 53 * math.log(2)
# How far below 1 - T w an id's uniform must be to be skipped: the bound's rounding
# (a few ulps of 1) is far below it, and a 1e-9 relative margin costs no logarithms.
_MARGIN = 1e-9
_I128, _I64 = ir.IntType(128), ir.IntType(64)


@intrinsic
def _mulhilo(typingctx: Any, a: Any, b: Any) -> Any:
    """``(hi, lo)``: the 128-bit product of two uint64, its high and low words."""
    pair = types.UniTuple(types.uint64, 2)  # type: ignore[no-untyped-call]
    sig = pair(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        p = builder.mul(builder.zext(args[0], _I128), builder.zext(args[1], _I128))
        lo = builder.trunc(p, _I64)
        hi = builder.trunc(builder.lshr(p, ir.Constant(_I128, 64)), _I64)
        return context.make_tuple(builder, sig.return_type, [hi, lo])

    return sig, codegen


@inner
def _philox(c0, c1, c2, c3, k0, k1):  # type: ignore[no-untyped-def]
    # Philox4x64-10 of counter (c0, c1, c2, c3) under key (k0, k1): four uint64 words
    for r in range(_ROUNDS):
        if r > 0:
            k0, k1 = k0 + _W0, k1 + _W1
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@entry(nogil=True)
def philox_block(c0, c1, c2, c3, k0, k1, out):  # type: ignore[no-untyped-def]
    """``out[:4]`` = Philox4x64-10 of the counter under the key (for the tests)."""
    a, b, c, d = _philox(c0, c1, c2, c3, k0, k1)
    out[0], out[1], out[2], out[3] = a, b, c, d


@entry(nogil=True)
def race_pick(weights, k0, k1, c1, c2, c3):  # type: ignore[no-untyped-def]
    """The id ``race`` picks from ``weights`` (float64 ``[V]``) with the exponentials of
    the stream at counter ``(0, c1, c2, c3)`` under key ``(k0, k1)`` (NumPy's Philox:
    id ``i`` is word ``i % 4`` of the block at counter ``i // 4 + 1``); -1 when no
    weight is positive."""
    n = weights.shape[0]
    best, first = -1, -1
    t = np.inf
    one = np.uint64(1)
    words = np.zeros(4, np.uint64)
    i = 0
    while i < n:
        if not weights[i] > 0:  # a tight scan past the ids truncation dropped
            i += 1
            continue
        lo = i - i % 4
        hi = min(n, lo + 4)
        a, b, c, d = _philox(np.uint64(lo // 4) + one, c1, c2, c3, k0, k1)
        words[0], words[1], words[2], words[3] = a, b, c, d
        for j in range(i, hi):
            w = weights[j]
            if not w > 0:
                continue
            if first < 0:
                first = j
            k = np.int64(words[j - lo] >> np.uint64(11))
            u = (k + 1) * 2.0**-53
            if u <= 1.0 - t * w * (1.0 + _MARGIN) - _MARGIN:
                continue  # -log(u) >= 1 - u > t w: slower than the best
            time = (_LOG_2_53 - math.log(k + 1.0)) / w
            if time < t:
                t, best = time, j
        i = hi
    return best if best >= 0 else first
