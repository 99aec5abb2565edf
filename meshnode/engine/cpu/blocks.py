"""Block decoders: the plain float formats as float32 vectors, and the scalar fields of blocks.

``chunk(fmt, row, c)`` returns values ``32 c .. 32 c + 31`` of an F32, F16 or BF16 ``row``
(the row's bytes, ``uint8``) as four :data:`.simd.F32x8` vectors; the quantized formats'
decoders are :mod:`.wide`'s (sixteen lanes). Here too are the scalar reads they share with
:mod:`.q8_kernels`: a float16 field (:func:`f16`), a little-endian ``u32``, and the K-quants'
packed six-bit scales (:func:`q3_k_scale`, :func:`k_scale_min`).

Block layouts are GGML's (``ggml-common.h``); ``QK_K`` is 256. The numbers the kernels
dispatch on are :data:`.formats.FORMATS`' kernel ids; :func:`format_row` is the row of
such a number while compiling, and :func:`decoder` the function a row names.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import overload

from meshnode.engine.cpu.formats import BY_KERNEL_ID, Format
from meshnode.engine.cpu.simd import (
    INNER,
    inner,
    intrinsic,
    load_bf16,
    load_f16,
    load_f32,
)


def _half_typer(typingctx: Any, bits: Any) -> tuple[Any, Any]:
    """float16 bits (``uint16``) to float32: an exact widening (F16C ``vcvtph2ps``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


# numba has no float16 on the CPU and no scalar bit casts: two LLVM instructions do it
_half_bits_to_f32: Any = intrinsic(_half_typer)


@inner
def f16(row, off):  # type: ignore[no-untyped-def]
    """The float16 at byte ``off`` of ``row``, as float32."""
    return _half_bits_to_f32(np.uint16(np.uint32(row[off]) | (np.uint32(row[off + 1]) << 8)))


@inner
def u32(row, off):  # type: ignore[no-untyped-def]
    return (
        np.uint32(row[off])
        | (np.uint32(row[off + 1]) << 8)
        | (np.uint32(row[off + 2]) << 16)
        | (np.uint32(row[off + 3]) << 24)
    )


# -- plain floats ------------------------------------------------------------------------


def _f32(fmt, row, c):  # type: ignore[no-untyped-def]
    o = 128 * c
    return load_f32(row, o), load_f32(row, o + 32), load_f32(row, o + 64), load_f32(row, o + 96)


def _f16(fmt, row, c):  # type: ignore[no-untyped-def]
    o = 64 * c
    return load_f16(row, o), load_f16(row, o + 16), load_f16(row, o + 32), load_f16(row, o + 48)


def _bf16(fmt, row, c):  # type: ignore[no-untyped-def]
    o = 64 * c
    return (
        load_bf16(row, o),
        load_bf16(row, o + 16),
        load_bf16(row, o + 32),
        load_bf16(row, o + 48),
    )


# -- the K-quants' packed scales (shared by the decoders of .wide and .q8_kernels) ------


@inner
def q3_k_scale(row, o, i):  # type: ignore[no-untyped-def]
    # 16 six-bit scales: low four bits in scales[0:8] (nibbles), high two in scales[8:12]
    lo = (row[o + i % 8] >> (4 * (i // 8))) & 15
    hi = (row[o + 8 + i % 4] >> (2 * (i // 4))) & 3
    return np.int32(lo | (hi << 4)) - 32


@inner
def k_scale_min(row, o, s):  # type: ignore[no-untyped-def]
    # Q4_K/Q5_K: eight 6-bit scales and mins packed in 12 bytes (gguf Q4_K.get_scale_min)
    if s < 4:
        return row[o + s] & 63, row[o + 4 + s] & 63
    sc = (row[o + 8 + s - 4] & 15) | ((row[o + s - 4] >> 2) & 48)
    mn = (row[o + 8 + s - 4] >> 4) | ((row[o + s] >> 2) & 48)
    return sc, mn


def literal_format(fmt: Any) -> int:
    """The kernel id that ``fmt``, the numba type of a format argument, holds as a
    compile-time constant (a closure's captured id, passed down as a literal).

    The kernels choose their decoders by format while compiling (with ``numba.extending.
    overload``): numba types every branch of a runtime ``if fmt == ...``, a literal
    argument included (its branch pruning folds comparisons with None only), so each
    kernel would compile every format's decoder. Raises ``TypingError`` otherwise."""
    if not isinstance(fmt, types.IntegerLiteral):
        raise TypingError(f"a block format must be a compile-time constant, got {fmt}")
    value: int = fmt.literal_value
    return value


def format_row(fmt: Any) -> Format:
    """The :data:`.formats.FORMATS` row of the kernel id that ``fmt`` (a numba type) holds
    as a compile-time constant (:func:`literal_format`). Raises ``TypingError`` if none."""
    row = BY_KERNEL_ID.get(literal_format(fmt))
    if row is None:
        raise TypingError(f"no block format has kernel id {fmt.literal_value}")
    return row


def decoder(name: str) -> Any:
    """The function a format row names: ``"wide._q4_0"`` is ``_q4_0`` of :mod:`.wide`.

    Resolved while compiling: the decoders' modules import numba, which
    :mod:`.formats` must not."""
    module, _, function = name.partition(".")
    found: Any = getattr(importlib.import_module(f"meshnode.engine.cpu.{module}"), function)
    return found


def chunk(fmt: int, row: Any, c: int) -> Any:
    """Values ``32 c .. 32 c + 31`` of ``row`` (F32, F16 or BF16) as four vectors.

    Compiled code only, ``fmt`` a compile-time constant (:func:`literal_format`)."""
    raise TypeError("chunk is for compiled code")


@overload(chunk, prefer_literal=True, jit_options=INNER)
def _chunk(fmt, row, c):  # type: ignore[no-untyped-def]
    row_format = format_row(fmt)
    if row_format.lanes != 8:
        raise TypingError(f"{row_format.name} has sixteen-lane decoders (.wide's wchunk)")
    return decoder(row_format.exact)
