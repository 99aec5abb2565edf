"""A row's values a group at a time, with the group's scales decoded once: the exact
products' (:mod:`.kernels`) reading of the sixteen-lane formats.

A *group* is a K-quant's super-block (256 values, eight 32-value sub-blocks) or one block
of a 32-value format. :func:`group_chunks` is its count of 32-value chunks (8 or 1);
:func:`group_scales` writes the scales of a row's group ``g`` into a small float32
scratch once, and :func:`group_chunk` returns chunk ``s`` of the group (values ``32 (G g
+ s) ..`` of the row) as two sixteen-lane vectors, reading those scales. A product then
decodes the scales of Q4_K (six-bit scales and mins packed in 12 bytes, two float16
factors) and Q6_K (sixteen int8 scales, one float16) once per super-block, not once per
sub-block as :func:`.wide.wchunk` does.

The values are :func:`.wide.wchunk`'s, bit for bit: the same float32 operations on the
same operands (``d * sc`` and ``-(dmin * m)`` computed once and kept in the scratch are
the numbers wchunk computes each time), so a product of either equals "dequantize, then
multiply". Formats with no scales to share here (the 32-value blocks, and the K-quants
other than Q4_K and Q6_K, rare in real files) read :func:`.wide.wchunk` directly, a group
of one chunk for the former and eight for the latter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba.extending import overload

from meshnode.engine.cpu.blocks import f16, format_row, k_scale_min
from meshnode.engine.cpu.simd import INNER, wfma, whigh_nibbles, wlow_nibbles, wmul, wsplat
from meshnode.engine.cpu.wide import wchunk, wq6

__all__ = ["SCALES", "group_chunk", "group_chunks", "group_scales"]

#: float32 scratch a row's group scales take (Q4_K: 8 ``d sc`` then 8 ``-(dmin m)``;
#: Q6_K: 16 ``d sc``).
SCALES = 16


def _q4_k_scales(fmt, row, g, sc, base):  # type: ignore[no-untyped-def]
    o = 144 * g  # d f16 | dmin f16 | scales[12] | qs[128]
    d, dmin = f16(row, o), f16(row, o + 2)
    for s in range(8):
        m, mn = k_scale_min(row, o + 4, s)
        sc[base + s] = d * np.float32(m)
        sc[base + 8 + s] = -(dmin * np.float32(mn))


def _q4_k_chunk(fmt, row, g, s, sc, base):  # type: ignore[no-untyped-def]
    # as wide._q4_k: nibble s % 2 of qs[32 (s // 2) ..], d sc q - dmin m in one fma
    qs = 144 * g + 16 + 32 * (s // 2)
    ds, dm = wsplat(sc[base + s]), wsplat(sc[base + 8 + s])
    if s % 2 == 0:
        return wfma(ds, wlow_nibbles(row, qs), dm), wfma(ds, wlow_nibbles(row, qs + 16), dm)
    return wfma(ds, whigh_nibbles(row, qs), dm), wfma(ds, whigh_nibbles(row, qs + 16), dm)


def _q6_k_scales(fmt, row, g, sc, base):  # type: ignore[no-untyped-def]
    o = 210 * g  # ql[128] | qh[64] | scales int8[16] | d f16
    d = f16(row, o + 208)
    for t in range(16):
        sc[base + t] = d * np.float32(np.int8(row[o + 192 + t]))


def _q6_k_chunk(fmt, row, g, s, sc, base):  # type: ignore[no-untyped-def]
    # as wide._q6_k: ((low | high << 4) - 32) times d sc, a scale per sixteen values
    o, h, m = 210 * g, s // 4, s % 4
    qa, qb = wq6(row, o + 64 * h + 32 * (m % 2), o + 128 + 32 * h, 4 * (m // 2), 2 * m)
    return wmul(wsplat(sc[base + 2 * s]), qa), wmul(wsplat(sc[base + 2 * s + 1]), qb)


def _no_scales(fmt, row, g, sc, base):  # type: ignore[no-untyped-def]
    pass


def _whole_chunk(fmt, row, g, s, sc, base):  # type: ignore[no-untyped-def]
    return wchunk(fmt, row, g)


def _k_chunk(fmt, row, g, s, sc, base):  # type: ignore[no-untyped-def]
    return wchunk(fmt, row, 8 * g + s)


_SHARED = {"Q4_K": (_q4_k_scales, _q4_k_chunk), "Q6_K": (_q6_k_scales, _q6_k_chunk)}


def _chunks(fmt: Any) -> int:
    return 8 if format_row(fmt).block_size == 256 else 1


def group_chunks(fmt: int) -> int:
    """32-value chunks in a group of ``fmt`` (compile-time constant): 8 or 1."""
    raise TypeError("for compiled code")


@overload(group_chunks, prefer_literal=True, jit_options=INNER)
def _group_chunks(fmt):  # type: ignore[no-untyped-def]
    n = _chunks(fmt)
    return lambda fmt: n


def group_scales(fmt: int, row: Any, g: int, sc: Any, base: int) -> None:
    """The scales of group ``g`` of ``row`` into ``sc[base : base + SCALES]`` (nothing for
    a format that reads its scales in :func:`group_chunk`)."""
    raise TypeError("for compiled code")


@overload(group_scales, prefer_literal=True, jit_options=INNER)
def _group_scales(fmt, row, g, sc, base):  # type: ignore[no-untyped-def]
    return _SHARED.get(format_row(fmt).name, (_no_scales,))[0]


def group_chunk(fmt: int, row: Any, g: int, s: int, sc: Any, base: int) -> Any:
    """Chunk ``s`` of group ``g`` of ``row`` as two sixteen-lane vectors, with the scales
    :func:`group_scales` wrote at ``sc[base]``: :func:`.wide.wchunk`'s values."""
    raise TypeError("for compiled code")


@overload(group_chunk, prefer_literal=True, jit_options=INNER)
def _group_chunk(fmt, row, g, s, sc, base):  # type: ignore[no-untyped-def]
    shared = _SHARED.get(format_row(fmt).name)
    if shared is not None:
        return shared[1]
    return _k_chunk if _chunks(fmt) == 8 else _whole_chunk
