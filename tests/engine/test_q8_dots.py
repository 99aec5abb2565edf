"""The integer dot products of the one-row 8-bit kernels on every path this CPU can
compile: :func:`.simd_int.dot4s` (weight bytes up to 128) and :func:`.simd_int.sdot4`
(int8 weights, Q8_0's) by ``vpmaddubsw`` (AVX2), by ``vpdpbusd`` (VNNI) and by the
portable widening code, each against the exact sums in int64, at the extremes where a
pair of products would pass int16 if the kernels took the wrong bytes."""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine.cpu import matrix

PATHS = [(False, False), (True, False), (False, True)]  # (madd_bytes, vnni)


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(31)


def _path(madd: bool, vnni: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile the next kernels for one path (the flags are read while compiling)."""
    matrix.kernels()  # numba configured first
    from meshnode.engine.cpu import simd_int

    if madd and not simd_int.madd_bytes():
        pytest.skip("this CPU has no AVX2")
    if vnni and not simd_int.vnni():
        pytest.skip("this CPU has no VNNI")
    monkeypatch.setattr(simd_int, "madd_bytes", lambda: madd)
    monkeypatch.setattr(simd_int, "vnni", lambda: vnni)


def _want(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    sums: np.ndarray = (w.astype(np.int64) * x.astype(np.int64)).reshape(8, 4).sum(1)
    return sums


@pytest.mark.parametrize(("madd", "vnni"), PATHS, ids=["generic", "madd", "vnni"])
def test_small_weight_bytes_dot_exactly(
    madd: bool, vnni: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    _path(madd, vnni, monkeypatch)
    from numba import njit

    from meshnode.engine.cpu import simd_int
    from meshnode.engine.cpu.simd import tofloat, vstore

    @njit(cache=False)
    def dot(w, x, out):  # type: ignore[no-untyped-def]
        vstore(out, 0, tofloat(simd_int.dot4s(simd_int.bload(w, 0), x, 0)))

    cases = [
        (rng.integers(0, 129, 32), rng.integers(-127, 128, 32)),
        ([128] * 32, [127] * 32),  # a pair: 32,512, just inside int16
        ([128] * 32, [-127] * 32),
        ([28, 0, 128, 1] * 8, [-127, 127, -127, 5] * 8),  # MXFP4's largest byte, mixed signs
    ]
    for w, x in cases:
        w8, x8 = np.asarray(w, np.uint8), np.asarray(x, np.int8)
        out = np.zeros(8, np.float32)
        dot(w8, x8.view(np.uint8), out)
        np.testing.assert_array_equal(out, _want(w8, x8))


@pytest.mark.parametrize(("madd", "vnni"), PATHS, ids=["generic", "madd", "vnni"])
def test_signed_weight_bytes_dot_exactly(
    madd: bool, vnni: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    _path(madd, vnni, monkeypatch)
    from numba import njit

    from meshnode.engine.cpu import simd_int
    from meshnode.engine.cpu.simd import tofloat, vstore

    @njit(cache=False)
    def dot(w, x, out):  # type: ignore[no-untyped-def]
        vstore(out, 0, tofloat(simd_int.sdot4(simd_int.bload(w, 0), x, 0)))

    cases = [
        (rng.integers(-128, 128, 32), rng.integers(-127, 128, 32)),
        ([-128] * 32, [-127] * 32),  # |w| 128: unsigned in vpmaddubsw
        ([-128] * 32, [127] * 32),
        ([127, -128, 0, -1] * 8, [127, 127, -127, -127] * 8),  # a zero weight, mixed signs
    ]
    for w, x in cases:
        w8, x8 = np.asarray(w, np.int8), np.asarray(x, np.int8)
        out = np.zeros(8, np.float32)
        dot(w8.view(np.uint8), x8.view(np.uint8), out)
        np.testing.assert_array_equal(out, _want(w8, x8))


@pytest.mark.parametrize("madd", [False, True], ids=["generic", "madd"])
@pytest.mark.parametrize("kind", ["small", "signed"])
def test_the_wide_dot_products_of_small_and_signed_bytes(
    madd: bool, kind: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dotw_small (bytes of at most 128) and dotw_signed (Q8_0's int8 weights, given as
    ``w + 128``): lane ``8 h + r`` adds the four bytes of lane ``j`` of chunk ``h`` times
    four int8 of row ``r``, exactly, without AVX512-VNNI (the multi-row kernel's paths on
    this CPU and on CPUs without AVX2)."""
    matrix.kernels()
    from numba import njit

    from meshnode.engine.cpu import simd_q8
    from meshnode.engine.cpu.simd_int import bload, madd_bytes

    if madd and not madd_bytes():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(simd_q8, "vnni512", lambda: False)  # read when it compiles
    monkeypatch.setattr(simd_q8, "madd_bytes", lambda: madd)
    dotw = simd_q8.dotw_signed if kind == "signed" else simd_q8.dotw_small

    @njit(cache=False)
    def dot(w, x, out):  # type: ignore[no-untyped-def]
        u = simd_q8.join64(bload(w, 0), bload(w, 32))
        acc = dotw(simd_q8.iload16(out, 0), u, 5, x, 0)
        simd_q8.store16(out, 0, acc)

    top = 256 if kind == "signed" else 129
    for w, x in [
        (rng.integers(0, top, 64), rng.integers(-127, 128, 64)),
        ([top - 1] * 64, [-127] * 64),
        ([0] * 64, [127] * 64),  # signed: every weight -128
    ]:
        w8, x8 = np.asarray(w, np.uint8), np.asarray(x, np.int8)
        start = rng.integers(-1000, 1000, 16).astype(np.int32)
        out = start.copy()
        dot(w8, x8.view(np.uint8), out.view(np.uint8))
        weights = w8.astype(np.int64) - (128 if kind == "signed" else 0)
        lanes = weights.reshape(2, 8, 4)[:, 5]  # [h, 4]: lane 5 of each chunk
        want = start + np.einsum("hi,hri->hr", lanes, x8.reshape(2, 8, 4)).reshape(16)
        np.testing.assert_array_equal(out, want)
