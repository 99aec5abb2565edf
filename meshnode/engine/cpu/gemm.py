"""Long products without BLAS: a compiled float32 GEMM whose sums have one order.

Prefill's products (more than :data:`.matrix.MAX_KERNEL_ROWS` activation rows) on a
machine whose sgemm rounds a row by its batch (:func:`.tiles.rows_independent`) come
here: the activations are packed once per product into panels of sixteen rows, K-major
(:func:`pack`: ``panel[g, k, l] = x[16 g + l, k]``, zero past the last row), and
:func:`product` multiplies weight rows -- a tile decoded to float32, or a float32 matrix
-- into them with a register block of :data:`BLOCK_ROWS` weight rows x sixteen
activation rows: per ``k`` one load of the panel, one broadcast of ``w[n, k]`` per
weight row and one FMA per accumulator (the classic GEMM micro-kernel, with the
activation rows as the vector lanes).

**One order.** Output ``[m, n]`` is lane ``m % 16`` of one accumulator: ``0``, then
``fmuladd(x[m, k], w[n, k], acc)`` for ``k = 0, 1, .., K - 1`` in turn, one rounding a
step where the CPU fuses (every x86 with AVX2 does). Nothing else touches it: not the
other rows of the batch (lanes are independent; the zero lanes past the last row are
never read), not the row's place (every lane runs the same chain), not the tile, the
thread or the block (the last weight rows of a range, fewer than a block, take blocks
of four, two and one row, the same chains), so a row's bits depend on nothing but its own
activations and its weights. The same order holds on AVX-512 (sixteen lanes are one
register there, two on AVX2): a row is the same bits on both, which sgemm's blocked
kernels never promised.

**Where it stands** (one thread, ``benchmarks/gemm_products.py --tiles``): a float32
tile runs at 85-93 % of this core's FMA peak, the tail blocks included. Blocking the
loops over ``k`` as a BLIS GEMM does (a panel's 256 values of ``k`` kept in the L1, 96
weight rows' in the L2, the chains' lanes stored between blocks: the same bits) was
10-25 % *slower* on Zen 3 (every block's six weight rows start new short streams the
prefetchers meet late, a likely cause): not kept.

On AVX-512 (Zen 5, one thread) the same loop ran at 45-50 % of the peak, OpenBLAS's
sgemm too: LLVM walked the block's weight rows with one pointer, ``add sn`` between
one row's FMA and the next's, a chain of one-cycle adds that let one FMA start a cycle
(on AVX2 each of those addresses feeds two FMAs, the two halves of sixteen lanes: no
loss there). The rows' offsets now pass through :func:`apart`, which LLVM cannot see
through, each row keeps its own register, and a tile's unit stride ``sk = 1`` is
compiled in (unrolled steps then differ by a displacement, not by more registers).
With blocks of twelve rows there: 113-118 -> 150-168 GFLOP/s, of a peak of ~240
(``benchmarks/gemm_products.py --tiles 512x2048 128x8192``); with two panels past six
rows instead (:func:`_pair6`, :data:`PAIRED`), 155-171 -> 179-213 GFLOP/s (75-89 %). A
panel left alone (an odd count: 33-48 prompt rows, 65-80, ..) goes past blocks of six:
twelve rows were 4-7 % faster there (``--rows 16``), not worth a second block kernel.

There, too, a pair of panels over a long ``k`` is more than the L2 holds (1 MiB on Zen 5:
two panels of the 1B shape's down projection, ``k = 8192``, are 1 MiB, the 8B shape's
1.8 MiB), so each block of six weight rows read them from the L3. The paired blocks
now go over at most :data:`K_PASS` values of ``k`` at a time (256 KiB of the two
panels), every block of the tile through one pass before the next, their twelve chains
stored between passes and loaded again as they were (the same chains, the same bits;
only the AVX-512 path: on AVX2 the BLIS blocking above lost). The tile 128 x 8192:
203 -> 227 GFLOP/s (75 -> 85 % of the peak); a 512-token exact prefill, the commit
before against this one (``benchmarks/trees.py BASE . --model 1b --layers 16 --mode
exact --threads T --rounds 5 --prefill 512``): 1.07x at one thread, 1.05x at two; the
8B shape's first 4 layers 1.07x at one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types

from meshnode.engine.cpu.simd import (
    F32x16,
    entry,
    inner,
    intrinsic,
    wfma,
    wlane,
    wload,
    wstore,
    wzero,
)
from meshnode.engine.cpu.simd_bytes import permutes

__all__ = ["BLOCK_ROWS", "LANES", "PAIRED", "apart", "pack", "packed", "panels", "product"]

LANES = 16  # activation rows a panel holds: one F32x16 per k
# Weight rows of the register block, for sixteen AVX2 registers: 6 x 2 accumulators,
# two for the panel's sixteen lanes, one broadcast; 8 loads per 12 FMAs (Zen 3: 3 load
# ports, 2 FMA). (Where sgemm's rows are independent, as on the Xeon, the tiles keep
# sgemm.)
BLOCK_ROWS = 6
# Where F32x16 is one register (AVX-512: 32 of them), the panels go two at a time past
# blocks of six weight rows (_pair6): twelve chains hide the FMA latency of two pipes (4
# cycles each), six do not; each lane's chain is the same, so are the bits
PAIRED = permutes()
# Values of k a pass of the paired blocks takes (two panels' 256 KiB: they stay in the L2
# while the tile's blocks go by). 1024 measured the same as 2048, 512 lost 5 % of a
# prefill (the chains' stores and loads, a pass's start)
K_PASS = 2048

# how packed() may cut its rows into parts: run(fn, rows, align) (.matrix.by_rows)
Parts = Callable[[Callable[[int, int], None], int, int], None]

_VW = ir.VectorType(ir.FloatType(), LANES)
_I32 = ir.IntType(32)
_VI = ir.VectorType(_I32, LANES)


@intrinsic
def wbroadcast(typingctx: Any, ary: Any, i: Any) -> Any:
    """``ary[i]`` of a C-contiguous float32 array in all sixteen lanes (one
    ``vbroadcastss`` from memory; no bounds check, no wraparound)."""
    if not (isinstance(ary, types.Array) and ary.dtype == types.float32 and ary.layout == "C"):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        value = builder.load(builder.gep(data, [args[1]]), align=4)
        undef = ir.Constant(_VW, ir.Undefined)
        one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, undef, ir.Constant(_VI, [0] * LANES))

    return F32x16(ary, i), codegen


@intrinsic
def apart(typingctx: Any, i: Any) -> Any:
    """``i`` (an int64), which the compiler cannot see through (an empty asm)."""
    if i != types.int64:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        asm = ir.InlineAsm(ir.FunctionType(i64, [i64]), "", "=r,0")
        return builder.call(asm, [args[0]], attrs=("readnone", "nounwind"))

    return types.int64(i), codegen


def _transposed(builder: Any, rows: list[Any]) -> list[Any]:
    # the sixteen vectors of a 16 x 16 block's columns, from its rows: four rounds, each
    # swapping one bit of the row's index with the same bit of the column's (two-source
    # shuffles, vpermt2ps)
    for d in (8, 4, 2, 1):
        low = [c if not c & d else LANES + c - d for c in range(LANES)]
        high = [c + d if not c & d else LANES + c for c in range(LANES)]
        for i in range(LANES):
            if not i & d:
                a, b = rows[i], rows[i + d]
                rows[i] = builder.shuffle_vector(a, b, ir.Constant(_VI, low))
                rows[i + d] = builder.shuffle_vector(a, b, ir.Constant(_VI, high))
    return rows


@intrinsic
def wtranspose16(typingctx: Any, x: Any, at: Any, stride: Any, live: Any, out: Any, to: Any) -> Any:
    """``out[to + 16 c + l] = x[at + stride l + c]`` for ``c, l < 16``: a 16 x 16 block of
    ``x`` (rows ``stride`` apart) transposed, its rows ``l >= live`` read as zeros (not
    read: they may lie past the end). Both flat C-contiguous float32; no bounds check."""
    flat = (types.Array(types.float32, 1, "C"),)
    if x not in flat or out not in flat:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        src = context.make_array(sig.args[0])(context, builder, args[0]).data
        dst = context.make_array(sig.args[4])(context, builder, args[4]).data
        i64 = ir.IntType(64)
        first, step, count, to = (
            context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 3, 5)
        )
        zero = ir.Constant(_VW, [0.0] * LANES)
        rows = []
        for lane in range(LANES):
            there = builder.icmp_signed("<", ir.Constant(i64, lane), count)
            off = builder.add(first, builder.mul(step, ir.Constant(i64, lane)))
            off = builder.select(there, off, first)  # a dead row reads row 0 (then zeros)
            ptr = builder.bitcast(builder.gep(src, [off]), _VW.as_pointer())
            rows.append(builder.select(there, builder.load(ptr, align=4), zero))
        for c, column in enumerate(_transposed(builder, rows)):
            at = builder.add(to, ir.Constant(i64, LANES * c))
            ptr = builder.bitcast(builder.gep(dst, [at]), _VW.as_pointer())
            builder.store(column, ptr, align=4)
        return context.get_dummy_value()

    return types.none(x, at, stride, live, out, to), codegen


def panels(rows: int) -> int:
    """Panels of :data:`LANES` activation rows that ``rows`` rows fill."""
    return -(-rows // LANES)


def packed(x: np.ndarray, run: Parts | None = None) -> np.ndarray:
    """``x`` ``[M, K]`` as :func:`pack`'s panels (a new flat float32 array, from a 64-byte
    line). ``run(fn, M, 16)``, where given, calls ``fn(lo, hi)`` for parts of the rows
    that cover them, each part's first row a multiple of sixteen, perhaps on other threads
    (:func:`.matrix.by_rows`); else all of them here."""
    n = panels(x.shape[0]) * x.shape[1] * LANES
    # from a 64-byte line: a panel's sixteen lanes are then one line, loaded as two 32-byte
    # halves that never straddle two lines (NumPy's arrays are 16-byte aligned)
    buf = np.empty(n + LANES, np.float32)
    at = (-(buf.ctypes.data // 4)) % LANES
    out = buf[at : at + n]
    x = np.ascontiguousarray(x, np.float32)

    def part(lo: int, hi: int) -> None:  # whole panels: lo is a multiple of sixteen
        pack(x[lo:hi], out[lo * x.shape[1] :])

    if run is None:
        part(0, x.shape[0])
    else:
        run(part, x.shape[0], LANES)
    return out


@entry(nogil=True)
def pack(x, out):  # type: ignore[no-untyped-def]
    """``out`` (flat, ``panels(M) * K * 16`` float32) = ``x`` ``[M, K]`` as K-major panels
    of sixteen rows, zero past the last row."""
    m, n_in = x.shape
    flat, whole = x.reshape(-1), n_in - n_in % 16
    for g in range(-(-m // 16)):
        base = g * n_in * 16
        live = min(16, m - g * 16)
        # sixteen values of k at a time, a 16 x 16 block transposed in registers (value by
        # value, the 1 KiB of panel kept in the L1, took ~1.8 ns a value: 0.11 s of a
        # 512-token prefill of the 1B shape, 2 % at one thread; row by row across the
        # whole panel wrote each line sixteen times from the L2); the last values of k,
        # fewer than sixteen, one at a time
        for k0 in range(0, whole, 16):  # a 16 x 16 block at a time, in registers
            wtranspose16(flat, g * 16 * n_in + k0, n_in, live, out, base + k0 * 16)
        for k0 in range(whole, n_in, 16):
            k1 = min(n_in, k0 + 16)
            for lane in range(live):
                r = g * 16 + lane
                for k in range(k0, k1):
                    out[base + k * 16 + lane] = x[r, k]
            for lane in range(live, 16):
                for k in range(k0, k1):
                    out[base + k * 16 + lane] = np.float32(0.0)


@inner
def _store(out, acc, r0, rows, col):  # type: ignore[no-untyped-def]
    # lane l of acc is out[r0 + l, col], for the rows that exist
    for lane in range(min(16, rows - r0)):
        out[r0 + lane, col] = wlane(acc, lane)


@inner
def _block(xp, base, n_in, w, p, sn, sk):  # type: ignore[no-untyped-def]
    # six weight rows (w[p + i * sn + k * sk]) x one panel (xp[base + 16 k ..]): six
    # accumulators of sixteen lanes, k = 0 .. n_in - 1 in turn. The rows' offsets apart:
    # each its own register (the module docstring)
    a0, a1, a2, a3, a4, a5 = wzero(), wzero(), wzero(), wzero(), wzero(), wzero()
    p1, p2, p3 = apart(p + sn), apart(p + 2 * sn), apart(p + 3 * sn)
    p4, p5 = apart(p + 4 * sn), apart(p + 5 * sn)
    for k in range(n_in):
        v = wload(xp, base + 16 * k)
        o = k * sk
        a0 = wfma(v, wbroadcast(w, p + o), a0)
        a1 = wfma(v, wbroadcast(w, p1 + o), a1)
        a2 = wfma(v, wbroadcast(w, p2 + o), a2)
        a3 = wfma(v, wbroadcast(w, p3 + o), a3)
        a4 = wfma(v, wbroadcast(w, p4 + o), a4)
        a5 = wfma(v, wbroadcast(w, p5 + o), a5)
    return a0, a1, a2, a3, a4, a5


@inner
def _pair6(xp, base, base2, k0, k1, w, p, sn, sk, acc):  # type: ignore[no-untyped-def]
    # six weight rows x two panels (xp[base ..], xp[base2 ..]; AVX-512): twelve chains,
    # each as _block's, from acc (zeros, or the chains as a pass over the k before k0
    # left them) on through k = k0 .. k1 - 1, and each weight value broadcast once for
    # both panels: per k two loads of the panels and six broadcasts for twelve FMAs, the
    # weights read from a tile that streams from the L3 once per two panels
    a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5 = acc
    p1, p2, p3 = apart(p + sn), apart(p + 2 * sn), apart(p + 3 * sn)
    p4, p5 = apart(p + 4 * sn), apart(p + 5 * sn)
    for k in range(k0, k1):
        v = wload(xp, base + 16 * k)
        u = wload(xp, base2 + 16 * k)
        o = k * sk
        c = wbroadcast(w, p + o)
        a0 = wfma(v, c, a0)
        b0 = wfma(u, c, b0)
        c = wbroadcast(w, p1 + o)
        a1 = wfma(v, c, a1)
        b1 = wfma(u, c, b1)
        c = wbroadcast(w, p2 + o)
        a2 = wfma(v, c, a2)
        b2 = wfma(u, c, b2)
        c = wbroadcast(w, p3 + o)
        a3 = wfma(v, c, a3)
        b3 = wfma(u, c, b3)
        c = wbroadcast(w, p4 + o)
        a4 = wfma(v, c, a4)
        b4 = wfma(u, c, b4)
        c = wbroadcast(w, p5 + o)
        a5 = wfma(v, c, a5)
        b5 = wfma(u, c, b5)
    return a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5


@njit(inline="always")
def _twelve(kept, at, k0):  # type: ignore[no-untyped-def]
    # the twelve chains of a pair: zeros where k0 is 0, else as kept[at ..] holds them
    if k0 == 0:
        z = wzero()
        return z, z, z, z, z, z, z, z, z, z, z, z
    return (
        wload(kept, at),
        wload(kept, at + 16),
        wload(kept, at + 32),
        wload(kept, at + 48),
        wload(kept, at + 64),
        wload(kept, at + 80),
        wload(kept, at + 96),
        wload(kept, at + 112),
        wload(kept, at + 128),
        wload(kept, at + 144),
        wload(kept, at + 160),
        wload(kept, at + 176),
    )


@njit(inline="always")
def _keep(kept, at, acc):  # type: ignore[no-untyped-def]
    # the twelve chains into kept[at .. at + 191], for the next pass over k: stored and
    # loaded as they are, so each chain goes on as if it had never stopped
    for j in range(12):
        wstore(kept, at + 16 * j, acc[j])


@inner
def _block4(xp, base, n_in, w, p, sn, sk):  # type: ignore[no-untyped-def]
    # four weight rows, each chain as _block's: eight chains keep both FMA pipes busy
    a0, a1, a2, a3 = wzero(), wzero(), wzero(), wzero()
    p1, p2, p3 = p + sn, p + 2 * sn, p + 3 * sn
    for k in range(n_in):
        v = wload(xp, base + 16 * k)
        o = k * sk
        a0 = wfma(v, wbroadcast(w, p + o), a0)
        a1 = wfma(v, wbroadcast(w, p1 + o), a1)
        a2 = wfma(v, wbroadcast(w, p2 + o), a2)
        a3 = wfma(v, wbroadcast(w, p3 + o), a3)
    return a0, a1, a2, a3


@inner
def _block2(xp, base, n_in, w, p, sn, sk):  # type: ignore[no-untyped-def]
    # two weight rows, each chain as _block's
    a0, a1 = wzero(), wzero()
    for k in range(n_in):
        v = wload(xp, base + 16 * k)
        o = k * sk
        a0 = wfma(v, wbroadcast(w, p + o), a0)
        a1 = wfma(v, wbroadcast(w, p + sn + o), a1)
    return a0, a1


@inner
def _one(xp, base, n_in, w, p, sk):  # type: ignore[no-untyped-def]
    # one weight row x one panel: the same chain as each of _block's accumulators
    a = wzero()
    for k in range(n_in):
        a = wfma(wload(xp, base + 16 * k), wbroadcast(w, p + k * sk), a)
    return a


@entry(nogil=True)
def product(xp, rows, w, sn, sk, n_w, out, col):  # type: ignore[no-untyped-def]
    """``out[:rows, col + n] = x @ weight row n`` for ``n < n_w``, where ``xp`` is
    :func:`pack`'s panels of ``x`` (``rows`` rows) and weight row ``n``'s value ``k`` is
    ``w[n * sn + k * sk]`` (``w`` flat float32: a decoded tile ``[n_w, K]`` has ``sn = K,
    sk = 1``, a matrix ``[K, N]``'s columns ``sn = 1, sk = N``)."""
    if sk == 1:  # a tile's: its constant 1 compiled in
        _product(xp, rows, w, sn, 1, n_w, out, col)
    else:
        _product(xp, rows, w, sn, sk, n_w, out, col)


@njit(inline="always")
def _product(xp, rows, w, sn, sk, n_w, out, col):  # type: ignore[no-untyped-def]
    groups = -(-rows // 16)
    n_in = xp.shape[0] // (16 * groups)
    full = n_w - n_w % BLOCK_ROWS
    first = 0  # the first panel that goes alone
    if PAIRED:  # AVX-512: two panels at a time, then an odd last one alone
        # at most K_PASS values of k a pass over the tile's blocks (the module docstring)
        kept = np.empty(12 * 16 * (full // BLOCK_ROWS) if n_in > K_PASS else 0, np.float32)
        for h in range(groups // 2):
            base, r0 = 2 * h * n_in * 16, 2 * h * 16
            base2, r2 = base + n_in * 16, r0 + 16
            for k0 in range(0, n_in, K_PASS):
                k1 = min(n_in, k0 + K_PASS)
                for n in range(0, full, BLOCK_ROWS):
                    at = 192 * (n // BLOCK_ROWS)  # 12 x 16 float32 a block
                    acc = _twelve(kept, at, k0)
                    acc = _pair6(xp, base, base2, k0, k1, w, n * sn, sn, sk, acc)
                    if k1 < n_in:
                        _keep(kept, at, acc)
                        continue
                    for i in range(BLOCK_ROWS):  # a tuple of one type: indexed by a run-time i
                        _store(out, acc[i], r0, rows, col + n + i)
                        _store(out, acc[BLOCK_ROWS + i], r2, rows, col + n + i)
            _tails(xp, base, n_in, w, sn, sk, full, n_w, out, r0, rows, col)
            _tails(xp, base2, n_in, w, sn, sk, full, n_w, out, r2, rows, col)
        first = groups - groups % 2
    for g in range(first, groups):  # a panel stays in the L2 while the tile's rows stream by
        base, r0 = g * n_in * 16, g * 16
        for n in range(0, full, BLOCK_ROWS):
            a0, a1, a2, a3, a4, a5 = _block(xp, base, n_in, w, n * sn, sn, sk)
            _store(out, a0, r0, rows, col + n)
            _store(out, a1, r0, rows, col + n + 1)
            _store(out, a2, r0, rows, col + n + 2)
            _store(out, a3, r0, rows, col + n + 3)
            _store(out, a4, r0, rows, col + n + 4)
            _store(out, a5, r0, rows, col + n + 5)
        _tails(xp, base, n_in, w, sn, sk, full, n_w, out, r0, rows, col)


@njit(inline="always")
def _tails(xp, base, n_in, w, sn, sk, n, n_w, out, r0, rows, col):  # type: ignore[no-untyped-def]
    # weight rows n .. n_w - 1 (fewer than a block) x the panel at base, into rows r0 ..
    # of out. The last rows, fewer than a block: four, two, then one at a time (one chain
    # alone waits on each FMA's latency: a 64-row tile's four last rows, the 8B
    # shape's down projection, cost ~19 % of the tile one at a time)
    if n + 4 <= n_w:
        a0, a1, a2, a3 = _block4(xp, base, n_in, w, n * sn, sn, sk)
        _store(out, a0, r0, rows, col + n)
        _store(out, a1, r0, rows, col + n + 1)
        _store(out, a2, r0, rows, col + n + 2)
        _store(out, a3, r0, rows, col + n + 3)
        n += 4
    if n + 2 <= n_w:
        a0, a1 = _block2(xp, base, n_in, w, n * sn, sn, sk)
        _store(out, a0, r0, rows, col + n)
        _store(out, a1, r0, rows, col + n + 1)
        n += 2
    if n < n_w:
        _store(out, _one(xp, base, n_in, w, n * sn, sk), r0, rows, col + n)
