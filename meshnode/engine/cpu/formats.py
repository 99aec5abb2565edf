"""The GGUF tensor formats a stage keeps in memory: one :class:`Format` row per format.

A weight matrix ``[out, in]`` is held as the file stores it: ``out`` rows of
``in / block_size`` blocks of ``type_size`` bytes each (GGML's layout, for which
``gguf.GGML_QUANT_SIZES`` is the table). Each row of :data:`FORMATS` carries every fact
about its format that code elsewhere needs: the geometry (from gguf), the id the compiled
kernels dispatch on, its exact decoder, how the 8-bit-activation kernels read it
(:class:`Q8`), and the C++ struct of the CUDA kernels that keep it as blocks. The
compile-time constants of :mod:`.q8_blocks`, the decoder tables of :mod:`.blocks`,
:mod:`.wide` and :mod:`.q8_blocks`, :data:`.q8.Q8_FORMATS` and :mod:`..cuda.formats`' tables
are all derived from these rows, so adding a format is one row here plus its decoders.

Decoders are named, not imported (``"wide._q4_0"``: function ``_q4_0`` of
:mod:`meshnode.engine.cpu.wide`): they are numba code, and numba must not be imported
before :func:`.matrix.configure_numba` has run (this module is imported by the engine
without it). The kernels resolve a name while compiling (:func:`.blocks.decoder`).
This module imports only gguf: it sits at the bottom of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import gguf

__all__ = ["BY_KERNEL_ID", "FORMATS", "Q8", "Format", "format_of", "row_bytes"]


@dataclass(frozen=True)
class Q8:
    """How the 8-bit-activation kernels (:mod:`.q8_kernels`) read a quantized format.

    Each 32-value chunk of a row is unpacked (``unpack``, a function of
    :mod:`.q8_blocks` or of the format's own module) to unsigned bytes ``u`` and a
    weight ``s (u - offset)``, ``s u + m`` (``minimum``), or both with an integer scale
    per 16 values (``per16``)."""

    unpack: str  # "q8_blocks._q4_0": the chunk's unpacker, (u, dw, m, m2, sa, sb)
    offset: int = 0  # z of a weight s (u - z), a power of two; 0: none
    minimum: int = 0  # 0: none; 1: one per 32-value chunk; 2: one per 16 values (Q2_K)
    per16: bool = False  # an integer scale per 16 values (Q2_K, Q3_K, Q6_K)
    # a 32-value block per chunk, led by its float16 scale (and float16 minimum): the
    # kernels read the scales of two chunks with one load and one conversion
    f16_head: bool = False
    # a block per chunk, led by its E8M0 scale byte (MXFP4): the one-row kernel reads the
    # scales of eight rows at once
    e8m0_head: bool = False

    def __post_init__(self) -> None:
        if self.offset & (self.offset - 1) or self.offset < 0:
            raise ValueError(f"{self.unpack}: offset {self.offset} is not a power of two")
        if self.minimum not in (0, 1, 2):
            raise ValueError(f"{self.unpack}: minimum kind {self.minimum} is not 0, 1 or 2")


@dataclass(frozen=True)
class Format:
    """One GGUF tensor type and everything the kernels need to know about it."""

    name: str  # GGML's type name (``gguf.GGMLQuantizationType``), as RawTensor.dtype
    kernel_id: int  # what the compiled kernels dispatch on (private to this package)
    block_size: int  # values per block
    type_size: int  # bytes per block
    # "module._name": the exact decoder of a 32-value chunk, bit-identical to gguf's
    # dequantize; in .blocks (eight lanes: four F32x8, the plain floats) or a module of
    # sixteen-lane decoders (two F32x16: .wide, .fp4)
    exact: str
    q8: Q8 | None = None  # the 8-bit-activation kernels' reading; None: exact kernels only
    cuda: str | None = None  # its C++ struct in cuda/kernels.SOURCE, if the GPU keeps it

    @property
    def lanes(self) -> Literal[8, 16]:
        """The vector width of :attr:`exact`'s values: 8 (:mod:`.blocks`) or 16."""
        return 8 if self.exact.startswith("blocks.") else 16


def _format(
    name: str, kernel_id: int, exact: str, q8: Q8 | None = None, cuda: str | None = None
) -> Format:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return Format(name, kernel_id, block, size, exact, q8, cuda)


# Kernel ids are private to this package (they are not GGML's enum values, which have gaps).
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _format("F32", 0, "blocks._f32", cuda="FmtF32"),
        _format("F16", 1, "blocks._f16", cuda="FmtF16"),
        _format("BF16", 2, "blocks._bf16", cuda="FmtBF16"),
        _format("Q4_0", 3, "wide._q4_0", Q8("q8_blocks._q4_0", offset=8, f16_head=True)),
        _format("Q4_1", 4, "wide._q4_1", Q8("q8_blocks._q4_1", minimum=1, f16_head=True)),
        _format("Q5_0", 5, "wide._q5_0", Q8("q8_blocks._q5_0", offset=16, f16_head=True)),
        _format("Q5_1", 6, "wide._q5_1", Q8("q8_blocks._q5_1", minimum=1, f16_head=True)),
        _format(
            "Q8_0",
            7,
            "wide._q8_0",
            Q8("q8_blocks._q8_0", offset=128, f16_head=True),  # int8 as w + 128
            cuda="FmtQ8_0",
        ),
        _format("Q2_K", 8, "wide._q2_k", Q8("q8_blocks._q2_k", minimum=2, per16=True)),
        _format("Q3_K", 9, "wide._q3_k", Q8("q8_blocks._q3_k", offset=4, per16=True)),
        _format("Q4_K", 10, "wide._q4_k", Q8("q8_blocks._q4_k", minimum=1), cuda="FmtQ4_K"),
        _format("Q5_K", 11, "wide._q5_k", Q8("q8_blocks._q5_k", minimum=1)),
        _format("Q6_K", 12, "wide._q6_k", Q8("q8_blocks._q6_k", offset=32, per16=True)),
        # one E8M0 scale byte and 32 E2M1 codes; u = kvalue + 16 (gpt-oss's experts)
        _format("MXFP4", 13, "fp4._mxfp4", Q8("fp4._mxfp4_q8", offset=16, e8m0_head=True)),
    )
}

#: The rows by kernel id (what the compiled code holds as a compile-time constant).
BY_KERNEL_ID: dict[int, Format] = {f.kernel_id: f for f in FORMATS.values()}


def format_of(dtype: str) -> Format | None:
    """The format of a tensor stored as ``dtype`` (a GGUF type name); None if unsupported."""
    return FORMATS.get(dtype)


def row_bytes(fmt: Format, n_in: int) -> int:
    """Bytes of one row of ``n_in`` values; raises ``ValueError`` unless whole blocks."""
    if n_in % fmt.block_size:
        raise ValueError(f"a row of {n_in} values is not whole {fmt.name} blocks")
    return n_in // fmt.block_size * fmt.type_size
