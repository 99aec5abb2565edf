"""The format rows (``engine/cpu/formats.py``): consistent with gguf, and the source of
every per-format table of the CPU kernels and the CUDA path."""

from __future__ import annotations

import typing

import gguf
import pytest
from numba import njit

from meshnode.engine.cpu import q8, q8_blocks
from meshnode.engine.cpu.blocks import decoder
from meshnode.engine.cpu.formats import BY_KERNEL_ID, FORMATS, Q8, Format, format_of, row_bytes
from meshnode.engine.cuda import formats as cuda_formats
from meshnode.engine.cuda import kernels as cuda_kernels

# The tables as they were written by hand before the rows (kernel id: value): the rows
# must still give the same constants for these formats.
_OFFSET_AREA = {3: 1, 4: -1, 5: 2, 6: -1, 7: 4, 8: -1, 9: 0, 10: -1, 11: -1, 12: 3}
_MINIMUM_KIND = {3: 0, 4: 1, 5: 0, 6: 1, 7: 0, 8: 2, 9: 0, 10: 1, 11: 1, 12: 0}
_BLOCK_BYTES = {3: 18, 4: 20, 5: 22, 6: 24, 7: 34, 8: 84, 9: 110, 10: 144, 11: 176, 12: 210}
_PER16 = {8, 9, 12}
_F16_HEAD = {3, 4, 5, 6, 7}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_row_has_gguf_geometry(name: str) -> None:
    fmt = FORMATS[name]
    qtype = gguf.GGMLQuantizationType[name]
    assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[qtype]
    assert format_of(name) is fmt
    assert BY_KERNEL_ID[fmt.kernel_id] is fmt
    assert row_bytes(fmt, 256 * fmt.block_size) == 256 * fmt.type_size


def test_kernel_ids_are_distinct_and_dense() -> None:
    assert sorted(BY_KERNEL_ID) == list(range(len(FORMATS)))


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_named_decoder_exists_where_its_lanes_say(name: str) -> None:
    fmt = FORMATS[name]
    assert callable(decoder(fmt.exact))
    assert fmt.exact.startswith("blocks.") == (fmt.lanes == 8)
    if fmt.q8 is not None:
        assert callable(decoder(fmt.q8.unpack))


def test_a_row_refuses_a_q8_reading_the_kernels_cannot_do() -> None:
    with pytest.raises(ValueError, match="power of two"):
        Q8("q8_blocks._x", offset=12)
    with pytest.raises(ValueError, match="minimum kind"):
        Q8("q8_blocks._x", minimum=3)


def _constants(kernel_id: int) -> tuple[int, int, int, bool, bool]:
    @njit
    def read():  # type: ignore[no-untyped-def]
        return (
            q8_blocks.offset_area(kernel_id),
            q8_blocks.minimum_kind(kernel_id),
            q8_blocks.block_bytes(kernel_id),
            q8_blocks.per16(kernel_id),
            q8_blocks.f16_head(kernel_id),
        )

    got: tuple[int, int, int, bool, bool] = read()
    return got


def _q8_rows() -> list[Format]:
    return [f for f in FORMATS.values() if f.q8 is not None]


@pytest.mark.parametrize("fmt", _q8_rows(), ids=lambda f: f.name)
def test_the_q8_kernels_constants_derive_from_the_rows(fmt: Format) -> None:
    """What compiled code reads for a format is its row's (and, for the formats that had
    hand-written tables, the same as those)."""
    assert fmt.q8 is not None
    area, kind, size, per16, head = _constants(fmt.kernel_id)
    shift = q8_blocks.OFFSET_SHIFTS[area] if area >= 0 else None
    assert shift == (fmt.q8.offset.bit_length() - 1 if fmt.q8.offset else None)
    assert (kind, size, per16, head) == (
        fmt.q8.minimum,
        fmt.type_size,
        fmt.q8.per16,
        fmt.q8.f16_head,
    )
    if fmt.kernel_id in _OFFSET_AREA:
        assert (area, kind, size) == (
            _OFFSET_AREA[fmt.kernel_id],
            _MINIMUM_KIND[fmt.kernel_id],
            _BLOCK_BYTES[fmt.kernel_id],
        )
        assert (per16, head) == (fmt.kernel_id in _PER16, fmt.kernel_id in _F16_HEAD)


def test_the_q8_formats_are_the_rows_with_a_q8_reading() -> None:
    assert {f.kernel_id for f in _q8_rows()} == q8.Q8_FORMATS
    assert q8_blocks.OFFSET_SHIFTS == (2, 3, 4, 5, 7)


def test_the_cuda_tables_derive_from_the_rows() -> None:
    on_device = {f.name.lower(): f for f in FORMATS.values() if f.cuda is not None}
    assert set(typing.get_args(cuda_formats.Format)) == set(on_device)
    assert {name: f.cuda for name, f in on_device.items()} == cuda_formats.CPP_NAME
    assert tuple(f.cuda for f in on_device.values()) == cuda_kernels.FORMATS
    assert cuda_formats.QUANT_FORMATS == {"Q8_0": "q8_0", "Q4_K": "q4_k"}
    for name, f in on_device.items():
        fmt = typing.cast(cuda_formats.Format, name)
        assert cuda_formats.row_bytes(fmt, 256) == 256 // f.block_size * f.type_size
