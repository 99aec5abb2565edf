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
