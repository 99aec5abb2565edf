"""SwiGLU's, GeGLU's and gpt-oss's clamped SwiGLU's activation of the fused gate/up
product as one compiled call.

:func:`meshnode.engine.ops.silu_mul` is seven NumPy calls over ``[r, I]`` (slices, maximum,
negation, exp, add, divide, multiply) and :func:`~meshnode.engine.ops.gelu_tanh_mul` ten:
for the few rows of a decode step their per-call cost, not the arithmetic, is what a
layer spends there (an 8-sequence step of SmolLM2: ~1.3 ms of 30 layers' activations,
against ~0.1 ms here). The expressions are the reference's, in its order, sixteen lanes
at a time; only the exponential is :func:`.vexp.wexp` (within 2 units in the last place of
the exact value, as NumPy's ``exp`` is) and GeGLU's ``tanh`` is
``1 - 2 / (1 + e^{2y})`` on it (within a unit in the last place of 1, to which the
reference adds it). Each row is computed alone: its result does not depend on the others.
"""

from __future__ import annotations

import numpy as np

from meshnode.engine.cpu.simd import entry, wadd, wload, wmul, wsplat, wstore
from meshnode.engine.cpu.vexp import wdiv, wexp, wmax

__all__ = ["GELU_TANH", "LANES", "SILU", "clamped_glu", "glu"]

LANES = 16  # the step over the intermediate size: it must be a multiple of it
SILU, GELU_TANH = 0, 1  # ``kind`` of glu()
_SILU_CLAMP = np.float32(-80.0)  # ops.SILU_CLAMP
_GELU_C = np.float32(0.7978845608028654)  # ops.GELU_TANH_C


@entry(nogil=True)
def glu(gate_up, kind, out):  # type: ignore[no-untyped-def]
    """``out[i] = act(gate[i]) * up[i]`` for ``gate_up`` ``[r, 2 I]`` (gate, then up) and
    ``out`` ``[r, I]``, float32 in C order, ``I`` a multiple of :data:`LANES`;
    ``act`` is SiLU (``kind`` :data:`SILU`) or GELU's tanh form (:data:`GELU_TANH`)."""
    rows, width = out.shape
    src, dst = gate_up.reshape(-1), out.reshape(-1)
    one, neg = wsplat(np.float32(1.0)), wsplat(np.float32(-1.0))
    clamp, two = wsplat(_SILU_CLAMP), wsplat(np.float32(2.0))
    c, cubic, half = wsplat(_GELU_C), wsplat(np.float32(0.044715)), wsplat(np.float32(0.5))
    for r in range(rows):
        at, to = 2 * r * width, r * width
        for i in range(0, width, LANES):
            g, u = wload(src, at + i), wload(src, at + width + i)
            if kind == SILU:
                # gate / (1 + exp(-max(gate, -80))) * up
                act = wdiv(g, wadd(one, wexp(wmul(neg, wmax(g, clamp)))))
                wstore(dst, to + i, wmul(act, u))
            else:
                # 0.5 * gate * (1 + tanh(c * (gate + 0.044715 * gate^3))) * up
                inner = wmul(c, wadd(g, wmul(cubic, wmul(wmul(g, g), g))))
                e = wexp(wmul(two, inner))
                tanh = wadd(one, wdiv(wmul(neg, two), wadd(one, e)))
                wstore(dst, to + i, wmul(wmul(wmul(half, g), wadd(one, tanh)), u))


@entry(nogil=True)
def clamped_glu(gate_up, alpha, limit, out):  # type: ignore[no-untyped-def]
    """gpt-oss's clamped SwiGLU, :func:`meshnode.engine.ops.clamped_swiglu_mul`'s
    expressions in its order with the vector exponential: for ``gate_up`` ``[r, 2 I]``
    (gate, then up) and ``out`` ``[r, I]`` (float32, C order, ``I`` a multiple of
    :data:`LANES`), ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``out = (u + 1) * (g * (1 / (1 + exp(-max(alpha g, -80)))))``."""
    rows, width = out.shape
    src, dst = gate_up.reshape(-1), out.reshape(-1)
    one, neg, clamp = wsplat(np.float32(1.0)), wsplat(np.float32(-1.0)), wsplat(_SILU_CLAMP)
    a, lo = wsplat(np.float32(alpha)), wsplat(-np.float32(limit))
    for r in range(rows):
        at, to = 2 * r * width, r * width
        for i in range(0, width, LANES):
            # min(x, limit) as -max(-x, -limit): negation is exact
            g = wmul(neg, wmax(wmul(neg, wload(src, at + i)), lo))
            u = wmax(wmul(neg, wmax(wmul(neg, wload(src, at + width + i)), lo)), lo)
            s = wdiv(one, wadd(one, wexp(wmul(neg, wmax(wmul(g, a), clamp)))))
            wstore(dst, to + i, wmul(wadd(u, one), wmul(g, s)))
