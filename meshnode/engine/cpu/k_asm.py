"""AVX2's exact one-row steps for Q4_K and Q6_K written in assembly: one weight row's
chain through a pair of Q4_K sub-blocks or through 64 values of a Q6_K half super-block,
for :mod:`.passes`.

The same float32 operations as :func:`.groups.group_chunk_at` and :mod:`.passes`' vector
IR, in the same order, so the same bits: a Q4_K value is ``fma(d sc, q, -dmin m)``, a
Q6_K one ``(d sc / 4) * (4 (q - 32))`` (:mod:`.sixbit`), each scale read from the
scratch where the pass stored :func:`.groups.group_scales`' lanes, and the chain is
``acc = fma(value, x, acc)`` sixteen values a step, ``j`` in order. What differs is who
allocates the registers. Written as vector IR, LLVM's schedulers shared each activation
load among the four rows of a pass and kept the decoded values alive across them: on
sixteen registers a fifth to a quarter of the loops' instructions were spills and reloads
(Q4_K: 941 instructions a super-block of four rows, 168 of them ``vmovups``; Q6_K: 1046),
and the instruction count bounded the loops (about four a cycle). Here each row's step is
one block LLVM cannot look into, five to ten registers, nothing spilled:

- Q4_K: four ``vpmovzxbd`` widen the pair's 32 bytes (eight to a register of int32), a
  ``vpand`` or a ``vpsrld`` picks each nibble (a byte widens to at most 255, so the high
  nibble is the byte shifted right by four), then per eight values one conversion, one
  FMA to the weight's value and one FMA with the activations straight from memory: 40
  instructions for 64 values (the loop: 799 a super-block of four rows).
- Q6_K: the bytes stay :func:`.sixbit.wq6_join`'s (each value the signed byte ``4 (q -
  32)``, stored to the scratch), joined for the four rows' whole super-block before any
  step reads them; per eight values one ``vpmovsxbd`` from there, one conversion, one
  multiply by the scale, one FMA: 36 instructions for 64 values (the loop: 918 a
  super-block of four rows). Joined a half at a time and read at once, the loads waited
  on the stores (the bytes did not forward): no faster than the vector IR.

Measured on an AMD EPYC (Zen 3, AVX2), ``benchmarks/exact_kernels.py --rows 1 --stat min
--baseline`` against the vector IR, cycles a weight in cache / streamed: Q4_K 0.27-0.30
-> 0.22-0.23 / 0.28-0.38 -> 0.22-0.28; Q6_K 0.28 -> 0.25 / 0.29 -> 0.25.

Taken where the CPU has AVX2 and FMA (:func:`assembles`), for the passes on sixteen
registers (:func:`.passes.one_row`); elsewhere the vector IR stays.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from llvmlite import binding, ir
from numba import types

from meshnode.engine.cpu.simd import F32x16, _is_array, intrinsic

__all__ = ["assembles", "wq4k_pair", "wq6k_steps"]

_F = ir.FloatType()
_I32 = ir.IntType(32)
_V8 = ir.VectorType(_F, 8)
_V8I = ir.VectorType(_I32, 8)
_V16 = ir.VectorType(_F, 16)
_V16I = ir.VectorType(_I32, 16)


# LLVM reads the assembly while it compiles, with its parser for this machine, which numba
# does not load: loaded on import, before anything compiles (a second call does nothing)
binding.initialize_native_asmparser()


@cache
def assembles() -> bool:
    """Whether this module's instructions run here: numba compiles for this CPU (not a
    CPU named by ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES``, e.g. a portable ``generic``
    build, whose assembler would refuse AVX2), an x86-64 one with AVX2 and FMA."""
    from numba.core import config

    named = getattr(config, "CPU_NAME", None), getattr(config, "CPU_FEATURES", None)
    if named[0] not in (None, "host") or named[1] is not None:
        return False
    features = binding.get_host_cpu_features()
    return binding.get_process_triple().startswith("x86_64") and all(
        features.get(name) for name in ("avx2", "fma")
    )


# Q4_K's operands: $0 $1 the chain's two halves (lanes 0-7, 8-15; tied to inputs $13
# $14), $2 .. $8 scratch registers (early-clobbered outputs: bytes 0-7, 8-15, 16-23, 24-31
# widened, a value, d sc, -dmin m), $9 the 32 bytes, $10 the activations x[p ..], $11 the
# scales (buf[at + s]: d sc of sub-block s, then of s + 1; -dmin m eight floats on), $12
# fifteen in each int32 lane. AT&T order: vfmadd213ps c, b, a is a = b a + c;
# vfmadd231ps c, b, a is a = b c + a.
_Q4_LOW = """
vpand $12, {b}, $6
vcvtdq2ps $6, $6
vfmadd213ps $8, $7, $6
vfmadd231ps {x}($10), $6, {acc}"""
_Q4_HIGH = """
vpsrld $$4, {b}, {b}
vcvtdq2ps {b}, {b}
vfmadd213ps $8, $7, {b}
vfmadd231ps {x}($10), {b}, {acc}"""
_Q4_PAIR = (
    """
vpmovzxbd ($9), $2
vpmovzxbd 8($9), $3
vpmovzxbd 16($9), $4
vpmovzxbd 24($9), $5
vbroadcastss ($11), $7
vbroadcastss 32($11), $8"""
    + "".join(_Q4_LOW.format(b=f"${2 + k}", x=32 * k, acc=f"${k % 2}") for k in range(4))
    + """
vbroadcastss 4($11), $7
vbroadcastss 36($11), $8"""
    + "".join(_Q4_HIGH.format(b=f"${2 + k}", x=128 + 32 * k, acc=f"${k % 2}") for k in range(4))
)
# "~{memory}": the blocks read memory (the scales the pass stored just before them;
# without it LLVM dropped those stores as dead)
_Q4_CONSTRAINTS = "=x,=x," + ",".join(["=&x"] * 7) + ",r,r,r,x,0,1,~{memory}"

# Q6_K's operands: $0 $1 the chain's halves (tied to $8 $9), $2 .. $4 scratch registers
# (two values, a scale), $5 the 64 joined bytes (signed, 4 (q - 32)), $6 the activations
# x[p ..], $7 the four quarter scales (d sc / 4, one a sixteen values)
_Q6_STEP = """
vbroadcastss {s}($7), $4
vpmovsxbd {b}($5), $2
vcvtdq2ps $2, $2
vmulps $4, $2, $2
vfmadd231ps {x}($6), $2, $0
vpmovsxbd {b8}($5), $3
vcvtdq2ps $3, $3
vmulps $4, $3, $3
vfmadd231ps {x32}($6), $3, $1"""
_Q6_STEPS = "".join(
    _Q6_STEP.format(s=4 * k, b=16 * k, b8=16 * k + 8, x=64 * k, x32=64 * k + 32) for k in range(4)
)
_Q6_CONSTRAINTS = "=x,=x,=&x,=&x,=&x,r,r,r,0,1,~{memory}"


def _data(context: Any, builder: Any, aryty: Any, ary: Any, index: Any) -> Any:
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.gep(data, [index])


def _halves(builder: Any, acc: Any) -> list[Any]:
    undef = ir.Constant(_V16, ir.Undefined)
    return [
        builder.shuffle_vector(acc, undef, ir.Constant(_V8I, list(range(h, h + 8)))) for h in (0, 8)
    ]


def _joined(builder: Any, res: Any) -> Any:
    low, high = builder.extract_value(res, 0), builder.extract_value(res, 1)
    return builder.shuffle_vector(low, high, ir.Constant(_V16I, list(range(16))))


@intrinsic
def wq4k_pair(
    typingctx: Any, row: Any, qs: Any, buf: Any, at: Any, x: Any, p: Any, acc: Any
) -> Any:
    """``acc`` through sub-blocks ``s`` and ``s + 1`` of a Q4_K row: the 32 bytes at byte
    ``qs`` of ``row`` (their low nibbles sub-block ``s``, their high ones ``s + 1``), the
    scales at ``buf[at]`` (:func:`.groups.group_scales`' lanes ``s ..``, stored), the
    activations ``x[p : p + 64]``: :func:`.passes._pair_at`'s chain, the same bits."""
    if not (
        _is_array(row, types.uint8)
        and _is_array(buf, types.float32)
        and _is_array(x, types.float32)
    ):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        rowty, _, bufty, _, xty, _, _ = sig.args
        q = _data(context, builder, rowty, args[0], args[1])
        scales = _data(context, builder, bufty, args[2], args[3])
        acts = _data(context, builder, xty, args[4], args[5])
        fifteen = ir.Constant(_V8I, [15] * 8)
        outs = ir.LiteralStructType([_V8] * 2 + [_V8I] * 4 + [_V8] * 3)
        fnty = ir.FunctionType(outs, [q.type, acts.type, scales.type, _V8I, _V8, _V8])
        asm = ir.InlineAsm(fnty, _Q4_PAIR, _Q4_CONSTRAINTS)
        args_ = [q, acts, scales, fifteen, *_halves(builder, args[6])]
        return _joined(builder, builder.call(asm, args_, attrs=("nounwind",)))

    return F32x16(row, qs, buf, at, x, p, acc), codegen


@intrinsic
def wq6k_steps(typingctx: Any, buf: Any, join: Any, at: Any, x: Any, p: Any, acc: Any) -> Any:
    """``acc`` through 64 values of a Q6_K row whose joined bytes
    (:func:`.sixbit.wq6_join`'s) are at ``buf[join]``, their four quarter scales at
    ``buf[at]``, the activations ``x[p : p + 64]``."""
    if not (_is_array(buf, types.float32) and _is_array(x, types.float32)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        bufty, _, _, xty, _, _ = sig.args
        joined = _data(context, builder, bufty, args[0], args[1])
        scales = _data(context, builder, bufty, args[0], args[2])
        acts = _data(context, builder, xty, args[3], args[4])
        outs = ir.LiteralStructType([_V8] * 5)
        fnty = ir.FunctionType(outs, [joined.type, acts.type, scales.type, _V8, _V8])
        asm = ir.InlineAsm(fnty, _Q6_STEPS, _Q6_CONSTRAINTS)
        args_ = [joined, acts, scales, *_halves(builder, args[5])]
        return _joined(builder, builder.call(asm, args_, attrs=("nounwind",)))

    return F32x16(buf, join, at, x, p, acc), codegen
