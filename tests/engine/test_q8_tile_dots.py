"""The 8-bit tiles' dot product (``simd_tile.dotb``) on every path a CPU can take: AVX512-VNNI's
``vpdpbusd``, AVX2's ``vpmaddubsw`` (bytes of at most 128 in one, Q8_0's split in two),
and the portable widening code: each the exact integer sums, at int16's limits too."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshnode.engine.cpu import simd_int, simd_q8, simd_tile
from meshnode.engine.cpu.formats import FORMATS

# (VNNI, AVX2) as the CPU is taken to have them while a test compiles
PATHS = {"generic": (False, False), "avx2": (False, True), "vnni": (True, False)}
Q4_K_ID, Q8_0_ID = FORMATS["Q4_K"].kernel_id, FORMATS["Q8_0"].kernel_id


def _cases(rng: np.random.Generator, top: int) -> list[tuple[Any, Any]]:
    """64 weight bytes of at most ``top`` and four int8 activations: random, and the
    largest bytes times -128 and 127 (two products' int16 sum at its limits)."""
    return [
        (rng.integers(0, top + 1, 64), rng.integers(-128, 128, 4)),
        ([top] * 64, [-128] * 4),
        ([top] * 64, [127] * 4),
        (rng.choice([0, 127, 128, top], 64), rng.choice([-128, -127, 127], 4)),
    ]


@pytest.mark.parametrize("fmt", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_tiles_dot_product_is_exact_on_every_path(
    path: str, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from numba import njit

    use_vnni, use_avx2 = PATHS[path]
    if use_vnni and not simd_q8.vnni512():
        pytest.skip("this CPU has no AVX512-VNNI")
    if use_avx2 and not simd_int.madd_bytes():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(simd_tile, "vnni512", lambda: use_vnni)  # read when it compiles
    monkeypatch.setattr(simd_tile, "madd_bytes", lambda: use_avx2)
    rng = np.random.default_rng(5)

    if fmt == "Q4_K":

        @njit(cache=False)
        def dot(w, x, out):  # type: ignore[no-untyped-def]
            acc = simd_q8.iload16(out, 0)
            simd_q8.store16(out, 0, simd_tile.dotb(acc, simd_tile.wload(w, 0), x, 0, Q4_K_ID))

    else:

        @njit(cache=False)
        def dot(w, x, out):  # type: ignore[no-untyped-def]
            acc = simd_q8.iload16(out, 0)
            simd_q8.store16(out, 0, simd_tile.dotb(acc, simd_tile.wload(w, 0), x, 0, Q8_0_ID))

    for w, x in _cases(rng, 128 if fmt == "Q4_K" else 255):
        w8, x8 = np.asarray(w, np.uint8), np.asarray(x, np.int8)
        start = rng.integers(-1000, 1000, 16).astype(np.int32)
        out = start.copy()
        dot(w8, x8.view(np.uint8), out.view(np.uint8))
        want = start + (w8.astype(np.int64).reshape(16, 4) * x8).sum(1)
        np.testing.assert_array_equal(out, want)


def test_only_q8_0_unpacks_bytes_past_128() -> None:
    # AVX2's single vpmaddubsw is exact only for bytes of at most 128: Q8_0 (w + 128) is
    # the one format whose bytes are split, and every other format is taken as small
    from numba import types

    wide = [
        f.name
        for f in FORMATS.values()
        if f.q8 is not None and not simd_tile._small_bytes(types.literal(f.kernel_id))  # type: ignore[no-untyped-call]
    ]
    assert wide == ["Q8_0"]
