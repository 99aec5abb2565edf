""":func:`.simd.wsums` cut after its first level, for the attention's score tiles
(:mod:`.attention_rows`): sixteen dot products' lane sums begun in registers as each
pair of them is finished, and ended once all sixteen are.

``wsums`` sums sixteen sixteen-lane vectors as a tree, each as :func:`.simd.wsum` would
(halves, then quarters...): its first level adds each vector's two halves and packs two
vectors' into one (:func:`wpair`: with AVX2, where a sixteen-lane vector is two
registers, two additions and no shuffle), the three levels after it shuffle lanes across
those. A tile that finishes two keys' dot products at a time takes the first level at
once, while they are in registers, and stores half the floats (eight vectors for sixteen
keys, not sixteen); :func:`wsums_pairs` ends the tree from there. The same additions in
the same order as ``wsums``: the same bits.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.simd import F32x16, _pair_sums, intrinsic

__all__ = ["wpair", "wsums_pairs"]

# Lanes of a vector (F32x16), and the width of wsums' first level's groups (its halves).
_LANES = 16
_HALF = _LANES // 2


@intrinsic
def wpair(typingctx: Any, a: Any, b: Any) -> Any:
    """The first level of :func:`.simd.wsums` for two of its vectors: lane ``i < 8`` is
    ``a[i] + a[i + 8]``, lane ``8 + i`` is ``b[i] + b[i + 8]``."""
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _pair_sums(builder, args[0], args[1], _HALF)

    return F32x16(a, b), codegen


@intrinsic
def wsums_pairs(typingctx: Any, vs: Any) -> Any:
    """:func:`.simd.wsums` of sixteen vectors from their first level: ``vs`` the eight
    :func:`wpair` of vectors ``(0, 1), (2, 3) ... (14, 15)``; lane ``i`` of the result is
    the sum of vector ``i``'s lanes, the same bits as ``wsums``' (and :func:`.simd.wsum`'s)."""
    if not (isinstance(vs, types.UniTuple) and vs.count == _HALF and vs.dtype == F32x16):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        pairs = list(cgutils.unpack_tuple(builder, args[0]))  # type: ignore[no-untyped-call]
        halves = [_pick(builder, p, p, range(h, h + _HALF)) for p in pairs for h in (0, _HALF)]
        return _pick(builder, _eight(builder, halves[:8]), _eight(builder, halves[8:]), range(16))

    return F32x16(vs), codegen


def _pick(builder: Any, a: Any, b: Any, lanes: Any) -> Any:
    """The vector of ``a``'s lanes then ``b``'s picked by ``lanes``."""
    mask = ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), list(lanes))
    return builder.shuffle_vector(a, b, mask)


def _add_picks(builder: Any, a: Any, b: Any, left: list[int], right: list[int]) -> Any:
    return builder.fadd(_pick(builder, a, b, left), _pick(builder, a, b, right))


def _eight(builder: Any, v8: list[Any]) -> Any:
    """Eight keys' sums (an eight-lane vector, key ``k``'s in lane ``k``) from their first
    levels ``v8`` (eight lanes each): wsum's remaining levels, in-lane shuffles where
    AVX2 has them. Level 2 pairs keys ``k`` and ``k + 4`` in one register ([k's lanes
    i + (i + 4) | k + 4's]); level 3 then level 4 interleave so that the last addition
    leaves the keys in order."""
    lo, hi = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    two = [_add_picks(builder, v8[k], v8[k + 4], lo, hi) for k in range(4)]  # [k | k+4]
    even, odd = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    three = [_add_picks(builder, two[k], two[k + 1], even, odd) for k in (0, 2)]
    first, second = [0, 2, 8, 10, 4, 6, 12, 14], [1, 3, 9, 11, 5, 7, 13, 15]
    return _add_picks(builder, three[0], three[1], first, second)
