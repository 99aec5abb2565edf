"""Q6_K's quants cut 64 at a time: a half super-block's six-bit values from 512-bit byte
vectors, already centred and in the sign bit, so each sixteen need one widening and one
conversion.

A Q6_K half super-block (128 values) is 64 bytes of low nibbles ``ql`` and 32 bytes of
two-bit fields ``qh``: value ``32 m + l`` (``m = 0 .. 3``, ``l = 0 .. 31``) is nibble
``m // 2`` of ``ql[32 (m % 2) + l]`` joined with bits ``2 m, 2 m + 1`` of ``qh[l]`` as
its fifth and sixth bits, minus 32 (gguf's ``dequantize_blocks``). :func:`.wide.wq6` cuts
one 32-value sub-block at a time from 256-bit vectors (five byte operations per 32 values
and a cross-lane extract per sixteen). :func:`wq6_quarter` cuts all four of a half from
two 512-bit vectors, the word shifts choosing each field's bits:

- the nibble goes to bits 2-5 of its byte (``ql << 2`` for the low nibbles of all 64
  bytes at once, ``ql >> 2`` for the high ones), the two-bit field to bits 6-7 (``qh``
  in both halves of a 512-bit vector, shifted by 6 and 4 for ``m = 0, 1``, 2 and 0 for
  ``m = 2, 3``), and the top bit flipped: the signed byte is ``4 (q - 32)``, the
  ``- 32`` done by the flip (a six-bit ``q`` with its top bit flipped is ``q - 32`` in
  two's complement), and bits 0-1 are zero.

A word shift moves bits across a byte boundary only into the bits the masks drop, so
each byte keeps its own fields. The joined bytes are stored once and widened sixteen at a
time by the load (``vpmovsxbd`` from memory), not extracted lane by lane.

:func:`wq6_join` stores a whole half's joined bytes (all four quarters, 128 bytes) into a
caller's scratch at once, and :func:`wq6_stored` reads a quarter back: the AVX2 one-row
passes (:mod:`.passes`), whose sixteen registers cannot hold four rows' halves between
their quarters. With :func:`wq6_quarter` there, each quarter stored its pair's 64 bytes
again and the rows' loaded bytes were spilled to the stack and read back for the next
pair (654 instructions a loop of 512 weights, 121 of them stores); joined once a half,
534 and 0.37 -> 0.28 cycles a weight in cache, 0.37 -> 0.31 streamed
(``benchmarks/exact_kernels.py --formats Q6_K --rows 1``).

Measured (issue 29): the one-row loop over four rows' half super-blocks is 272
instructions (282 before), 80 cycles by a static port count with port 1 closed to
512-bit uops (106 before); eight rows 1.2-1.3x main's speed, one row within the noise
(side by side against main, min of single calls, load 4-6; an idle run is owed).

**The same bits**: the product ``d * sc * (q - 32)`` of a float16 ``d`` (11 significant
bits), an int8 scale (at most 7) and ``q - 32`` (at most 5) has at most 23 significant
bits, so it is exact in float32 whatever the order of its factors. The decoders
compute ``(d * sc) * (q - 32)``, each step exact; this module's callers compute
``(d * sc / 4) * (4 (q - 32))``, each step exact too (a power of two; ``d * sc / 4``
is at least ``2**-26``, a normal float32): the same float32, with the same sign for
zeros. NaN and infinite ``d`` give NaN and infinities as before.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils

from meshnode.engine.cpu.lookup import permutes
from meshnode.engine.cpu.simd import F32x16, intrinsic

__all__ = ["wq6_join", "wq6_quarter", "wq6_stored"]

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_B64 = ir.VectorType(_I8, 64)
_B32 = ir.VectorType(_I8, 32)
_B16 = ir.VectorType(_I8, 16)
_W32 = ir.VectorType(_I16, 32)
_VF = ir.VectorType(ir.FloatType(), 16)
_VI = ir.VectorType(_I32, 16)
_VI64 = ir.VectorType(_I32, 64)


def _load(builder: Any, data: Any, off: Any, vty: Any) -> Any:
    # a load of the weights' bytes: they never change while a product runs, so loads of
    # the same bytes by the four chunks of a half are one load (invariant.load)
    ptr = builder.bitcast(builder.gep(data, [off]), vty.as_pointer())
    load = builder.load(ptr, align=1)
    load.set_metadata("invariant.load", builder.module.add_metadata([]))
    return load


def _words(builder: Any, v: Any, op: str, shifts: list[int]) -> Any:
    # a word shift (each half of the 512 bits by its own count) of a byte vector
    words = builder.bitcast(v, _W32)
    amount = ir.Constant(_W32, [shifts[i // 16] for i in range(32)])
    return builder.bitcast(getattr(builder, op)(words, amount), _B64)


def _ternary(builder: Any, a: Any, b: Any, c: Any, table: int, generic: Any) -> Any:
    # one vpternlogq (the bitwise function whose truth table is `table`) where AVX-512
    # has it, else the same function as plain IR
    if not permutes():
        return generic(a, b, c)
    q = ir.VectorType(_I64, 8)
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(q, [q, q, q, _I32]), "llvm.x86.avx512.pternlog.q.512"
    )
    a, b, c = (builder.bitcast(v, q) for v in (a, b, c))
    return builder.bitcast(builder.call(fn, [a, b, c, ir.Constant(_I32, table)]), _B64)


def _splat8(value: int) -> Any:
    return ir.Constant(_B64, [value] * 64)


# truth tables of vpternlog over (a, b, c): bit (a << 2 | b << 1 | c) of the table
_AND_XOR = 0x6A  # (a & b) ^ c: 0xF0 & 0xCC ^ 0xAA
_AND_OR = 0xEA  # (a & b) | c: 0xF0 & 0xCC | 0xAA


def _field(builder: Any, v: Any, mask: int, flip: int) -> Any:
    # the two-bit field under mask, its top bit flipped, every other bit zero
    def generic(a: Any, b: Any, c: Any) -> Any:
        return builder.xor(builder.and_(a, b), c)

    return _ternary(builder, v, _splat8(mask), _splat8(flip), _AND_XOR, generic)


def _join(builder: Any, nibbles: Any, field: Any) -> Any:
    # bits 2-5 from the nibbles' vector, the rest from the field's (zero but its 6-7)
    def generic(a: Any, b: Any, c: Any) -> Any:
        return builder.or_(builder.and_(a, b), c)

    return _ternary(builder, nibbles, _splat8(0x3C), field, _AND_OR, generic)


def _launder(builder: Any, ptr: Any) -> Any:
    # the same address, which the compiler cannot see is: the bytes stored there are read
    # back from memory sixteen at a time, widened by the load (vpmovsxbd from memory),
    # not extracted from the register lane by lane
    fnty = ir.FunctionType(ptr.type, [ptr.type])
    return builder.call(ir.InlineAsm(fnty, "", "=r,0"), [ptr])


def _joined(builder: Any, data: Any, ql: Any, qh: Any, first: Any) -> Any:
    # the 64 joined bytes of quarters 0 and 1 (first, an i1) or 2 and 3 of a half
    low = _load(builder, data, ql, _B64)
    fields = _load(builder, data, qh, _B32)
    both = builder.shuffle_vector(fields, fields, ir.Constant(_VI64, list(range(32)) * 2))
    # m = 2, 3: the fields at bits 4-5 and 6-7 of qh, to 6-7 (qh << 2 and qh);
    # m = 0, 1: bits 0-1 and 2-3, to 2-3 (the same shifts), then four more
    upper = _words(builder, both, "shl", [2, 0])
    nibbles = builder.select(
        first, _words(builder, low, "shl", [2, 2]), _words(builder, low, "lshr", [2, 2])
    )
    fields = builder.select(
        first,
        _words(builder, _field(builder, upper, 0x0C, 0x08), "shl", [4, 4]),
        _field(builder, upper, 0xC0, 0x80),
    )
    return _join(builder, nibbles, fields)


def _signed_floats(builder: Any, start: Any) -> Any:
    # the 32 signed bytes at start, as two sixteen-lane float32 vectors (vpmovsxbd from
    # memory, eight a load)
    halves = []
    for first_byte in (0, 16):
        ptr = builder.gep(start, [ir.Constant(_I64, first_byte)])
        part = builder.load(builder.bitcast(ptr, _B16.as_pointer()), align=1)
        halves.append(builder.sitofp(builder.sext(part, _VI), _VF))
    return halves


def _is_row(row: Any) -> bool:
    return isinstance(row, types.Array) and row.dtype == types.uint8 and row.layout == "C"


def _is_floats(buf: Any) -> bool:
    return isinstance(buf, types.Array) and buf.dtype == types.float32 and buf.layout == "C"


@intrinsic
def wq6_quarter(typingctx: Any, row: Any, ql: Any, qh: Any, m: Any) -> Any:
    """Values ``32 m .. 32 m + 31`` (``m`` 0-3) of the Q6_K half super-block whose 64
    low-nibble bytes are at byte ``ql`` of ``row`` and 32 two-bit-field bytes at ``qh``, as
    ``4 (q - 32)``: two float32 vectors, exact. The four quarters of a half share their
    loads and byte operations once inlined (``m`` constant there: the choices fold)."""
    if not (_is_row(row) and isinstance(m, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        quarter = context.cast(builder, args[3], sig.args[3], types.int64)
        first = builder.icmp_signed("<", quarter, ir.Constant(_I64, 2))
        slot = cgutils.alloca_once(builder, _B64)  # type: ignore[no-untyped-call]
        slot.align = 64
        builder.store(_joined(builder, data, args[1], args[2], first), slot)
        at = builder.mul(builder.and_(quarter, ir.Constant(_I64, 1)), ir.Constant(_I64, 32))
        start = builder.gep(_launder(builder, builder.bitcast(slot, _I8.as_pointer())), [at])
        return context.make_tuple(builder, sig.return_type, _signed_floats(builder, start))

    pair = types.UniTuple(F32x16, 2)  # type: ignore[no-untyped-call]
    return pair(row, ql, qh, m), codegen


def _bytes_of(context: Any, builder: Any, aryty: Any, ary: Any, at: Any, atty: Any) -> Any:
    # the address of float32 element `at` of a float32 array, as bytes
    data = context.make_array(aryty)(context, builder, ary).data
    at = context.cast(builder, at, atty, types.int64)
    return builder.bitcast(builder.gep(data, [at]), _I8.as_pointer())


@intrinsic
def wq6_join(typingctx: Any, row: Any, ql: Any, qh: Any, buf: Any, at: Any) -> Any:
    """A whole Q6_K half super-block (``ql``, ``qh`` as :func:`wq6_quarter`'s), joined as
    there and stored as 128 signed bytes ``4 (q - 32)`` from float32 element ``at`` of
    ``buf`` on: quarter ``m`` at bytes ``32 m ..``, for :func:`wq6_stored` to read."""
    if not (_is_row(row) and _is_floats(buf) and isinstance(at, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        dest = _bytes_of(context, builder, sig.args[3], args[3], args[4], sig.args[4])
        for i, first in enumerate((True, False)):
            ptr = builder.gep(dest, [ir.Constant(_I64, 64 * i)])
            joined = _joined(builder, data, args[1], args[2], ir.Constant(ir.IntType(1), first))
            builder.store(joined, builder.bitcast(ptr, _B64.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(row, ql, qh, buf, at), codegen


@intrinsic
def wq6_stored(typingctx: Any, buf: Any, at: Any, m: Any) -> Any:
    """Quarter ``m`` (0-3) of the half :func:`wq6_join` stored at ``buf[at]``: the values
    :func:`wq6_quarter` returns, read back sixteen at a time by the loads that widen them."""
    if not (_is_floats(buf) and isinstance(at, types.Integer) and isinstance(m, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        start = _launder(
            builder, _bytes_of(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        )
        quarter = context.cast(builder, args[2], sig.args[2], types.int64)
        start = builder.gep(start, [builder.mul(quarter, ir.Constant(_I64, 32))])
        return context.make_tuple(builder, sig.return_type, _signed_floats(builder, start))

    pair = types.UniTuple(F32x16, 2)  # type: ignore[no-untyped-call]
    return pair(buf, at, m), codegen
