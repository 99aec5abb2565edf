"""Q6_K's quants cut 64 at a time (:mod:`meshnode.engine.cpu.sixbit`): each quarter of a
half super-block is ``4 (q - 32)`` for gguf's six-bit ``q``, with the vpternlog operations
and with their plain-IR form.

The Q6_K decoders that use them are checked bit for bit against gguf's ``dequantize`` in
``test_cpu_kernels.py`` (random and extreme blocks); here the pieces."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numba import njit

from meshnode.engine.cpu import lookup, sixbit
from meshnode.engine.cpu.simd import wstore


def _kernels() -> Any:
    # compiled afresh (no disk cache): lookup.permutes() is read while compiling
    @njit
    def quarters(row, out):  # type: ignore[no-untyped-def]
        for m in range(4):  # a runtime m: the choices stay in the code
            a, b = sixbit.wq6_quarter(row, 0, 64, m)
            wstore(out, 32 * m, a)
            wstore(out, 32 * m + 16, b)

    return quarters


def _want(row: np.ndarray) -> np.ndarray:
    # gguf's Q6_K: value 32 m + l of the half is nibble m // 2 of ql[32 (m % 2) + l] with
    # bits 2 m, 2 m + 1 of qh[l] above it, minus 32
    ql, qh = row[:64].astype(np.int32), row[64:96].astype(np.int32)
    out = []
    for m in range(4):
        low = (ql[32 * (m % 2) : 32 * (m % 2) + 32] >> (4 * (m // 2))) & 15
        out.append(low | ((qh >> (2 * m)) & 3) << 4)
    return 4.0 * (np.concatenate(out) - 32)


@pytest.mark.parametrize("ternlog", [True, False], ids=["vpternlog", "plain"])
def test_quarters_are_four_times_the_centred_quants(
    ternlog: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ternlog and not lookup.permutes():
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setattr(sixbit, "permutes", lambda: ternlog)
    quarters = _kernels()
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 256, 96, dtype=np.uint8) for _ in range(4)]
    rows += [np.full(96, fill, np.uint8) for fill in (0x00, 0xFF, 0x55, 0xAA)]  # the limits
    for row in rows:
        out = np.zeros(128, np.float32)
        quarters(row, out)
        np.testing.assert_array_equal(out, _want(row))


def test_a_half_joined_into_a_scratch_reads_back_as_its_quarters() -> None:
    """``wq6_join`` stores a half's four quarters as 128 bytes at a float32 place of a
    scratch, touching nothing around them, and ``wq6_stored`` reads each back as
    ``wq6_quarter`` gives it (the AVX2 one-row passes keep a half there between its
    quarters)."""

    @njit
    def joined(row, buf, at, out):  # type: ignore[no-untyped-def]
        sixbit.wq6_join(row, 0, 64, buf, at)
        for m in range(4):  # a runtime m
            a, b = sixbit.wq6_stored(buf, at, m)
            wstore(out, 32 * m, a)
            wstore(out, 32 * m + 16, b)

    rng = np.random.default_rng(6)
    rows = [rng.integers(0, 256, 96, dtype=np.uint8) for _ in range(3)]
    rows += [np.full(96, fill, np.uint8) for fill in (0x00, 0xFF, 0x55, 0xAA)]
    for at in (0, 7, 160):  # any float32 place, aligned to 4 bytes only
        for row in rows:
            buf = rng.standard_normal(at + 64).astype(np.float32)
            before = buf.copy()
            out = np.zeros(128, np.float32)
            joined(row, buf, at, out)
            np.testing.assert_array_equal(out, _want(row))
            kept = np.r_[0:at, at + 32 : at + 64]
            np.testing.assert_array_equal(buf[kept], before[kept])
            stored = buf[at : at + 32].view(np.int8).astype(np.float32)
            np.testing.assert_array_equal(stored, _want(row))
