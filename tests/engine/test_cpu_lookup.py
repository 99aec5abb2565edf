"""Table lookup of four-bit quants (:mod:`meshnode.engine.cpu.lookup`): the permute and its
scalar fallback pick ``table[nibble]``, and a table holds the decoders' own values.

The decoders that use it are checked bit for bit against gguf's ``dequantize`` in
``test_cpu_kernels.py`` (every format, random and extreme blocks); here the pieces."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numba import njit

from meshnode.engine.cpu import lookup
from meshnode.engine.cpu.simd import wadd, wfma, wmul, wsplat, wstore


def _kernels() -> tuple[Any, Any]:
    # compiled afresh (no disk cache): lookup.permutes() is read while compiling
    @njit
    def pick(row, out):  # type: ignore[no-untyped-def]
        identity = lookup.wiota(0)  # lane k holds k
        wstore(out, 0, lookup.wlookup(identity, row, 0, False))
        wstore(out, 16, lookup.wlookup(identity, row, 0, True))

    @njit
    def tables(d, m, out):  # type: ignore[no-untyped-def]
        # the tables, then each lane as the decoders compute a nibble of value k
        wstore(out, 0, wfma(wsplat(d), lookup.wiota(0), wsplat(m)))
        wstore(out, 16, wmul(wsplat(d), lookup.wiota(-8)))  # d * (k - 8), Q4_0's form
        for k in range(16):
            q = wsplat(np.float32(k))
            wstore(out, 32 + 16 * k, wfma(wsplat(d), q, wsplat(m)))
            wstore(out, 288 + 16 * k, wmul(wsplat(d), wadd(q, wsplat(np.float32(-8.0)))))

    return pick, tables


@pytest.mark.parametrize("permute", [True, False], ids=["permute", "scalar"])
def test_a_lookup_picks_the_lane_of_each_nibble(
    permute: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if permute and not lookup.permutes():
        pytest.skip("this CPU has no sixteen-lane permute (AVX-512)")
    monkeypatch.setattr(lookup, "permutes", lambda: permute)
    pick, _ = _kernels()
    row = np.random.default_rng(3).integers(0, 256, 16, dtype=np.uint8)
    row[:2] = 0x0F, 0xF0  # both nibbles at their limits
    out = np.zeros(32, np.float32)
    pick(row, out)
    np.testing.assert_array_equal(out[:16], row & 15)
    np.testing.assert_array_equal(out[16:], row >> 4)


def test_tables_hold_the_decoders_values() -> None:
    # lane k: wfma(d, k, m) (Q4_K, Q4_1) and d * (k - 8) (Q4_0) as the decoders compute them
    _, tables = _kernels()
    out = np.zeros(32 + 2 * 256, np.float32)
    for d, m in [(0.0123, -0.4567), (-3.0e-5, 7.25), (65504.0, -65504.0)]:
        tables(np.float32(d), np.float32(m), out)
        each = out[32:].reshape(2, 16, 16)
        np.testing.assert_array_equal(out[:16], each[0, :, 0])
        np.testing.assert_array_equal(out[16:32], each[1, :, 0])
