"""AVX2's form of the Q4_K one-row super-block step (:mod:`.q8_superblocks`): the
integer dot products of eight weight rows' chunk pair summed in 16-bit lanes, four rows
to a 128-bit lane.

On AVX-512 the step keeps two chunks of a row in a 512-bit register and sums each row's
``vpdpbusd`` lanes across the rows in 32-bit lanes (``.q8_superblocks._isums``).
Lowered to AVX2's sixteen 256-bit registers that compiled to about 780 instructions per
super-block of eight rows, 140 of them spills, with lane-crossing permutes at every level
of the sums. Here each row's chunk pair is two ``vpmaddubsw`` (its sixteen int16 lanes:
two products each, at most ``2 * 15 * 127``) and the sums across the rows stay in 16-bit
lanes inside each 128-bit lane for three levels (unpack and add: at most ``16 * 15 *
127 = 30480``, below ``2**15``: exact) before one ``vpmaddwd`` adds the two 128-bit
halves of each row in 32 bits. The sums come out as ``[even chunk: rows 0-3, odd chunk:
rows 0-3, even: rows 4-7, odd: rows 4-7]`` (:func:`by_four`), not ``[even: rows 0-7,
odd: rows 0-7]``, which would take a lane-crossing permute per level; the scales are
moved to that order once per super-block (:func:`lanes`) and the two accumulators'
lanes added back in row order at the end (:func:`rows8`). Each lane meets the same
float32 operations in the same order as in the other order: the same bits.

Chosen when the CPU has ``vpmaddubsw`` on 256-bit registers but no 512-bit
``vpdpbusd`` (:func:`by_four`); elsewhere :mod:`.q8_superblocks`' own order stays.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from meshnode.engine.cpu.simd_int import _x86, madd_bytes
from meshnode.engine.cpu.simd_q8 import vnni512

__all__ = [
    "by_four",
    "bytes_by_four",
    "dots_by_four",
    "lanes",
    "pair",
    "q6_dots_by_four",
    "rows8",
    "scales_by_four",
    "sums_by_four",
]

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F = ir.FloatType()
_VB = ir.VectorType(_I8, 32)
_VH = ir.VectorType(_I16, 16)
_VD = ir.VectorType(_I32, 8)
_VQ = ir.VectorType(_I64, 4)
_VI16 = ir.VectorType(_I32, 16)
_VF16 = ir.VectorType(_F, 16)

# Lane i of the four-row order holds lane _ORDER[i] of the eight-row one (even chunk:
# lanes 0-7, odd: 8-15, a row each)
_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def by_four() -> bool:
    """Whether the Q4_K one-row step takes this module's order (AVX2 without
    AVX512-VNNI)."""
    return madd_bytes() and not vnni512()


def _unpack(builder: Any, a: Any, b: Any, n: int, high: bool) -> Any:
    # AVX2's unpack of a and b as n elements of 256 / n bits (n / 2 a 128-bit lane):
    # within each 128-bit lane, the low (high) halves of a's and b's elements interleaved
    ty = ir.VectorType(ir.IntType(256 // n), n)
    per_lane = n // 2  # elements in one 128-bit lane
    pick = []
    for lane in range(2):
        base = lane * per_lane + (per_lane // 2 if high else 0)
        for i in range(per_lane // 2):
            pick += [base + i, n + base + i]
    out = builder.shuffle_vector(
        builder.bitcast(a, ty), builder.bitcast(b, ty), ir.Constant(ir.VectorType(_I32, n), pick)
    )
    return builder.bitcast(out, _VH)


def _sum_pair(builder: Any, a: Any, b: Any, n: int) -> Any:
    # one level of the sums across rows: a's and b's elements (n a register) interleaved,
    # low halves plus high halves of each 128-bit lane, in int16 lanes
    return builder.add(_unpack(builder, a, b, n, False), _unpack(builder, a, b, n, True))


def _halves(builder: Any, x: Any) -> list[Any]:
    """The two 32-byte halves of the 64 activation bytes at ``x`` (``i8*``)."""
    return [
        builder.load(
            builder.bitcast(builder.gep(x, [ir.Constant(_I64, 32 * h)]), _VB.as_pointer()),
            align=1,
        )
        for h in range(2)
    ]


def dots_by_four(builder: Any, ptrs: list[Any], x: Any) -> Any:
    """The exact integer dot products of chunks ``2 k`` and ``2 k + 1`` of eight Q4_K
    rows (their 32 bytes of nibbles at ``ptrs``, ``i8*``) with the activation blocks at
    ``x`` (``i8*``, 64 bytes), sixteen int32 in this module's order."""
    xs = _halves(builder, x)
    mask = ir.Constant(_VB, [15] * 32)

    def row(p: Any) -> tuple[Any, Any]:
        # a row's even chunk (low nibbles) and odd one (high) times theirs activations:
        # sixteen int16 each, pairs of products
        v = builder.load(builder.bitcast(p, _VB.as_pointer()), align=1)
        low = builder.and_(v, mask)
        high = builder.lshr(builder.bitcast(v, _VH), ir.Constant(_VH, [4] * 16))
        high = builder.and_(builder.bitcast(high, _VB), mask)
        return (
            _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _VH, low, xs[0]),
            _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _VH, high, xs[1]),
        )

    def rows(lo: int, hi: int) -> tuple[Any, Any]:
        # rows lo .. hi - 1 summed in int16 (n: their elements a register at this level),
        # in the order of emission as of the sums, so that few registers are live at once
        if hi - lo == 1:
            return row(ptrs[lo])
        mid = (lo + hi) // 2
        a, b = rows(lo, mid), rows(mid, hi)
        n = {2: 16, 4: 8, 8: 4}[hi - lo]
        return _sum_pair(builder, a[0], b[0], n), _sum_pair(builder, a[1], b[1], n)

    # int16 r of 128-bit lane L: the sum of row r's eight int16 in lane L
    e, o = rows(0, 8)
    # [e lane 0 | o lane 0] and [e lane 1 | o lane 1], interleaved by row: a row's two
    # halves side by side, which vpmaddwd adds in 32 bits
    first = builder.shuffle_vector(
        e, o, ir.Constant(ir.VectorType(_I32, 16), list(range(8)) + list(range(16, 24)))
    )
    second = builder.shuffle_vector(
        e, o, ir.Constant(ir.VectorType(_I32, 16), list(range(8, 16)) + list(range(24, 32)))
    )
    ones = ir.Constant(_VH, [1] * 16)
    halves = [
        _x86(builder, "llvm.x86.avx2.pmadd.wd", _VD, _unpack(builder, first, second, 16, h), ones)
        for h in (False, True)
    ]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16))))


def sums_by_four(builder: Any, a: Any, b: Any, level: int) -> Any:
    """One level of the sums across eight rows of sixteen int32 each (lanes 0-7: a
    row's even chunk, 8-15: its odd one), in this module's order at the last: level 1
    adds rows ``a``, ``b`` within each 128-bit lane (unpack of 32-bit elements), level 2
    two such pairs (of 64-bit elements), then lane ``r`` of each 128-bit lane holds row
    ``r`` (of four) of it; level 3 adds the two 128-bit lanes of each chunk, rows 0-3 from
    ``a``, rows 4-7 from ``b``. Exact (int32)."""
    if level == 3:
        halves = []
        for v in (a, b):
            lo = builder.shuffle_vector(v, v, ir.Constant(_VD, [0, 1, 2, 3, 8, 9, 10, 11]))
            hi = builder.shuffle_vector(v, v, ir.Constant(_VD, [4, 5, 6, 7, 12, 13, 14, 15]))
            halves.append(builder.add(lo, hi))
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI16, list(range(16))))
    size = 1 if level == 1 else 2  # int32 a unit
    picks: list[list[int]] = [[], []]
    for lane in range(4):  # 128-bit lanes: 0-1 the even chunk's, 2-3 the odd one's
        for high in range(2):
            start = 4 * lane + 2 * high
            for i in range(2 // size):
                for src in (0, 16):
                    picks[high] += [src + start + size * i + k for k in range(size)]
    lo = builder.shuffle_vector(a, b, ir.Constant(_VI16, picks[0]))
    hi = builder.shuffle_vector(a, b, ir.Constant(_VI16, picks[1]))
    return builder.add(lo, hi)


def _paired(builder: Any, rows: list[Any]) -> list[Any]:
    # eight rows' sixteen bytes as four registers: rows j and j + 4 in register j
    pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
    return [builder.shuffle_vector(rows[j], rows[j + 4], pick) for j in range(4)]


def _transposed(builder: Any, paired: list[Any]) -> list[Any]:
    # bytes of rows paired as _paired's: byte v of rows 4 g .. 4 g + 3 side by side in
    # 128-bit lane g of register v // 4, at bytes 4 (v % 4) .. 4 (v % 4) + 3 (unpacks of
    # bytes, then of their pairs)
    bytes01 = [_unpack(builder, paired[0], paired[1], 32, h) for h in (False, True)]
    bytes23 = [_unpack(builder, paired[2], paired[3], 32, h) for h in (False, True)]
    return [
        _unpack(builder, bytes01[i], bytes23[i], 16, h) for i in range(2) for h in (False, True)
    ]


def bytes_by_four(builder: Any, rows: list[Any]) -> list[Any]:
    """Eight rows' sixteen bytes (``<16 x i8>`` each) moved so that byte ``v`` of rows
    ``4 g`` .. ``4 g + 3`` sit side by side, at bytes ``4 (v % 4)`` .. of 128-bit lane ``g``
    of register ``v // 4`` (four ``<16 x i16>``)."""
    return _transposed(builder, _paired(builder, rows))


def scales_by_four(builder: Any, rows: list[Any], layout: Any, d: Any, dmin: Any) -> list[Any]:
    """:func:`.q8_superblocks.q4_k_scales8`'s eight vectors in this module's order, from
    the eight rows' sixteen bytes at the scales (``rows``, ``<16 x i8>``), the source
    bytes, masks and shifts of ``layout`` (``_k_scale_layout``) and ``d``, ``-dmin`` of
    the rows (eight float32 each, a row a lane): each row's bytes decoded in a 128-bit
    lane (rows ``j`` and ``j + 4`` in one register), then moved so that pair ``k``'s
    bytes of four rows sit side by side (a transpose by unpacks), widened, times ``d`` or
    ``-dmin``: the same float32 products."""
    lo_src, hi_src, mask, shift = layout
    zero = ir.Constant(_VB, [0] * 32)
    pick = ir.VectorType(_I32, 32)
    decoded = []
    for r in _paired(builder, rows):
        a = builder.shuffle_vector(
            r, zero, ir.Constant(pick, [16 * ln + x for ln in range(2) for x in lo_src])
        )
        counts = ir.Constant(_VH, [shift[2 * i] for i in range(8)] * 2)
        a = builder.and_(
            builder.bitcast(builder.lshr(builder.bitcast(a, _VH), counts), _VB),
            ir.Constant(_VB, mask * 2),
        )
        b = builder.shuffle_vector(
            r,
            zero,
            ir.Constant(pick, [32 if x < 0 else 16 * ln + x for ln in range(2) for x in hi_src]),
        )
        b = builder.bitcast(builder.lshr(builder.bitcast(b, _VH), ir.Constant(_VH, [2] * 16)), _VB)
        decoded.append(builder.or_(a, builder.and_(b, ir.Constant(_VB, [0x30] * 32))))
    t = _transposed(builder, decoded)
    heads = [
        builder.shuffle_vector(f, f, ir.Constant(_VI16, [0, 1, 2, 3] * 2 + [4, 5, 6, 7] * 2))
        for f in (d, dmin)
    ]
    out: list[Any] = [None] * 8
    for k in range(4):  # pair k: sc in bytes 0-7 of each lane, mn in bytes 8-15
        v = builder.bitcast(t[k], _VB)
        for m in range(2):
            idx = [8 * m + i for i in range(8)] + [16 + 8 * m + i for i in range(8)]
            b = builder.shuffle_vector(v, v, ir.Constant(_VI16, idx))
            f = builder.uitofp(builder.zext(b, _VI16), _VF16)
            out[4 * m + k] = builder.fmul(heads[m], f)
    return out


def lanes(builder: Any, v: Any) -> Any:
    """Sixteen float32 in the eight-row order (even chunk: lanes 0-7, odd: 8-15) in this
    module's."""
    return builder.shuffle_vector(v, v, ir.Constant(_VI16, _ORDER))


def pair(builder: Any, a: Any, b: Any) -> Any:
    """``a`` in the even chunk's lanes, ``b`` in the odd one's (this module's order)."""
    undef = ir.Constant(_VF16, ir.Undefined)
    v = builder.insert_element(undef, a, ir.Constant(_I32, 0))
    v = builder.insert_element(v, b, ir.Constant(_I32, 1))
    return builder.shuffle_vector(v, v, ir.Constant(_VI16, [0, 0, 0, 0, 1, 1, 1, 1] * 2))


def rows8(builder: Any, v: Any) -> Any:
    """Even plus odd chunk of each of the eight rows (lane ``j``: row ``j``), from
    sixteen float32 in this module's order."""
    undef = ir.Constant(_VF16, ir.Undefined)
    even = builder.shuffle_vector(v, undef, ir.Constant(_VD, [0, 1, 2, 3, 8, 9, 10, 11]))
    odd = builder.shuffle_vector(v, undef, ir.Constant(_VD, [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.fadd(even, odd)


def q6_dots_by_four(builder: Any, row: Any, x: Any, scales: Any) -> Any:
    """A Q6_K chunk pair of eight rows in this module's order: for each row ``j`` and
    chunk, ``s_lo D_lo + s_hi D_hi``, ``D`` the exact sum of ``(u - 32) x`` over a half
    chunk of 16 values and ``s`` its int8 scale, as sixteen int32 (:func:`dots_by_four`'s
    lanes). ``row(j)``: row ``j``'s 64 six-bit quants (``<64 x i8>``, emitted as the sums
    ask for them); ``x``: the 64 activation quants (``i8*``); ``scales``: ``<32 x i8>``,
    bytes ``4 j`` .. ``4 j + 3`` row ``j``'s scales of the first chunk's halves, then of
    the second's.

    Each row's half chunk is eight int16 ``vpmaddubsw`` pair sums less those of ``32 x``
    (within +-8128) in one 128-bit lane; two levels of sums across four rows stay in
    int16 (unpacks of 32- then 64-bit elements: a row's lane is then four pair sums,
    within +-32512, two of them side by side), then one ``vpmaddwd`` with the row's scale
    in both words finishes the half and applies its scale in int32, and the halves are
    added. The same integers as :func:`.q8_q6_k.kq6` with :func:`.q8_q6_k.kscale` (one
    ``vpmaddwd`` with ones per row and chunk, and ``vpmulld`` on the sums, fewer)."""
    xs = _halves(builder, x)
    thirty_two = ir.Constant(_VB, [32] * 32)
    offs = [_x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _VH, thirty_two, xh) for xh in xs]
    pick = [ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32))) for h in (0, 1)]

    def dots(j: int) -> tuple[Any, Any]:
        # row j's two chunks: sixteen int16 pair sums of (u - 32) x each
        u = row(j)
        a, b = (
            builder.sub(
                _x86(
                    builder, "llvm.x86.avx2.pmadd.ub.sw", _VH,
                    builder.shuffle_vector(u, u, pick[h]), xs[h],
                ),
                offs[h],
            )
            for h in (0, 1)
        )  # fmt: skip
        return a, b

    def rows(lo: int, hi: int) -> tuple[Any, Any]:
        # rows lo .. hi - 1 (two or four) summed in int16: unpacks of 32-bit elements for
        # two rows, of 64-bit ones for four
        if hi - lo == 1:
            return dots(lo)
        mid = (lo + hi) // 2
        a, b = rows(lo, mid), rows(mid, hi)
        n = 8 if hi - lo == 2 else 4
        return _sum_pair(builder, a[0], b[0], n), _sum_pair(builder, a[1], b[1], n)

    out = []
    for g in range(2):  # rows 0-3, rows 4-7
        chunks = rows(4 * g, 4 * g + 4)
        scaled = []
        for k in range(2):
            # words 2 i, 2 i + 1 of 128-bit lane L: row 4 g + i's scale of half L of chunk k
            idx = [4 * (4 * g + i) + 2 * k + half for half in (0, 1) for i in range(4)]
            idx = [at for at in idx for _ in (0, 1)]  # a scale in both words of a lane
            pick16 = ir.Constant(ir.VectorType(_I32, 16), idx)
            s = builder.sext(builder.shuffle_vector(scales, scales, pick16), _VH)
            scaled.append(_x86(builder, "llvm.x86.avx2.pmadd.wd", _VD, chunks[k], s))
        # each chunk's two halves added: rows 4 g .. 4 g + 3 of the first chunk, then of
        # the second
        first = ir.Constant(_VD, [0, 1, 2, 3, 8, 9, 10, 11])
        second = ir.Constant(_VD, [4, 5, 6, 7, 12, 13, 14, 15])
        out.append(
            builder.add(
                builder.shuffle_vector(scaled[0], scaled[1], first),
                builder.shuffle_vector(scaled[0], scaled[1], second),
            )
        )
    return builder.shuffle_vector(out[0], out[1], ir.Constant(_VI16, list(range(16))))
