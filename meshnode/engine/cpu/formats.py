"""The GGUF tensor formats a CPU stage keeps in memory, and their block geometry.

A weight matrix ``[out, in]`` is held as the file stores it: ``out`` rows of
``in / block_size`` blocks of ``type_size`` bytes each (GGML's layout, for which
``gguf.GGML_QUANT_SIZES`` is the table). The kernels in :mod:`.dequant` are written against
exactly these layouts; the number beside each name is the id the kernels dispatch on.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

__all__ = ["FORMATS", "Format", "format_of", "row_bytes"]


@dataclass(frozen=True)
class Format:
    """One GGUF tensor type: its kernel id, values per block and bytes per block."""

    name: str
    kernel_id: int
    block_size: int
    type_size: int


def _format(name: str, kernel_id: int) -> Format:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return Format(name, kernel_id, block, size)


# Kernel ids are private to this package (they are not GGML's enum values, which have gaps).
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _format("F32", 0),
        _format("F16", 1),
        _format("BF16", 2),
        _format("Q4_0", 3),
        _format("Q4_1", 4),
        _format("Q5_0", 5),
        _format("Q5_1", 6),
        _format("Q8_0", 7),
        _format("Q2_K", 8),
        _format("Q3_K", 9),
        _format("Q4_K", 10),
        _format("Q5_K", 11),
        _format("Q6_K", 12),
    )
}


def format_of(dtype: str) -> Format | None:
    """The format of a tensor stored as ``dtype`` (a GGUF type name); None if unsupported."""
    return FORMATS.get(dtype)


def row_bytes(fmt: Format, n_in: int) -> int:
    """Bytes of one row of ``n_in`` values; raises ``ValueError`` unless whole blocks."""
    if n_in % fmt.block_size:
        raise ValueError(f"a row of {n_in} values is not whole {fmt.name} blocks")
    return n_in // fmt.block_size * fmt.type_size
