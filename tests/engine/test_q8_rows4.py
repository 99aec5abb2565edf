"""The one-row K-quant steps of ``--dtype q8`` in AVX2's four-row order (:mod:`.q8_rows4`)
and in AVX-512's eight-row one: the same integer sums and the same float32 lanes, only
moved. Each order is compiled here where the CPU can run it (the order is read while
compiling: :func:`.q8_rows4.by_four`, patched)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshnode.engine.cpu import q8  # noqa: F401  (numba configured before it is imported)

ORDERS = [False, True]
# lane i of the four-row order holds lane ORDER[i] of the eight-row one
ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(29)


def order(four: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """q8_superblocks with its order patched to ``four`` (skips where the CPU cannot)."""
    from meshnode.engine.cpu import q8_superblocks
    from meshnode.engine.cpu.simd_int import madd_bytes

    if four and not madd_bytes():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(q8_superblocks, "by_four", lambda: four)
    return q8_superblocks


def nibble_rows(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Eight rows' 32 bytes of nibbles and 64 activation quants: random ones, and those
    that take the int16 sums to their bounds (every nibble 15 against +-127)."""
    cases = [(rng.integers(0, 256, (8, 32)), rng.integers(-127, 128, 64))]
    cases.append((np.full((8, 32), 255), np.full(64, 127)))
    cases.append((np.full((8, 32), 255), np.full(64, -127)))
    mixed = np.full((8, 32), 255)
    mixed[1::2] = 0x0F  # odd rows: only the even chunk's nibbles
    cases.append((mixed, np.tile([127, -127], 32)))
    return [(np.asarray(u, np.uint8), np.asarray(x, np.int8)) for u, x in cases]


def reference(u: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Lanes 0-7: row j's low nibbles times x[:32], 8-15: its high nibbles times x[32:]."""
    low, high = (u & 15).astype(np.int64), (u >> 4).astype(np.int64)
    xs = x.astype(np.int64)
    return np.concatenate([low @ xs[:32], high @ xs[32:]])


@pytest.mark.parametrize("four", ORDERS, ids=["eight-row", "four-row"])
def test_q4_k_chunk_pair_dots_are_exact_in_either_order(
    four: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q4_k_dots8: each row's two chunks' exact integer dot products, in the lanes of
    the order it was compiled for, at rows' offsets of any alignment."""
    from numba import njit

    from meshnode.engine.cpu.simd_q8 import store16

    sb = order(four, monkeypatch)

    @njit(cache=False)
    def dots(w, bases, x, out):  # type: ignore[no-untyped-def]
        at = (bases[0], bases[1], bases[2], bases[3], bases[4], bases[5], bases[6], bases[7])
        store16(out, 0, sb.q4_k_dots8(w, at, 3, x, 0))

    for u, x in nibble_rows(rng):
        bases = np.array([0, 40, 77, 130, 171, 205, 250, 290], np.int64)  # + 3: at
        w = np.zeros(330, np.uint8)
        for j, b in enumerate(bases):
            w[b + 3 : b + 35] = u[j]
        out = np.zeros(16, np.int32)
        dots(w, bases, x.view(np.uint8), out.view(np.uint8))
        want = reference(u, x)
        np.testing.assert_array_equal(out, want[ORDER] if four else want)


@pytest.mark.parametrize("four", ORDERS, ids=["eight-row", "four-row"])
def test_the_sums_across_rows_level_by_level_in_either_order(
    four: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ksum's three levels over eight rows' sixteen int32 (Q6_K's step): each row's
    sums of lanes 0-7 and 8-15, in the order compiled for, exactly, up to int32's
    range."""
    from numba import njit

    from meshnode.engine.cpu.simd_q8 import iload16, store16

    sb = order(four, monkeypatch)

    @njit(cache=False)
    def sums(v, out):  # type: ignore[no-untyped-def]
        p01 = sb.ksum(iload16(v, 0), iload16(v, 64), 1)
        p23 = sb.ksum(iload16(v, 128), iload16(v, 192), 1)
        p45 = sb.ksum(iload16(v, 256), iload16(v, 320), 1)
        p67 = sb.ksum(iload16(v, 384), iload16(v, 448), 1)
        store16(out, 0, sb.ksum(sb.ksum(p01, p23, 2), sb.ksum(p45, p67, 2), 3))

    for v in (rng.integers(-(2**27), 2**27, (8, 16)), np.full((8, 16), 2**28 - 1)):
        v32 = np.asarray(v, np.int32)
        out = np.zeros(16, np.int32)
        sums(v32.view(np.uint8).reshape(-1), out.view(np.uint8))
        want = np.concatenate([v32[:, :8].sum(1), v32[:, 8:].sum(1)]).astype(np.int32)
        np.testing.assert_array_equal(out, want[ORDER] if four else want)


@pytest.mark.parametrize("four", ORDERS, ids=["eight-row", "four-row"])
def test_the_float_lanes_move_and_fold_back_to_rows(
    four: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """klanes moves a scale vector as q4_k_dots8 orders its sums, kpair puts a chunk's
    scale in its lanes, krows adds each row's two chunks back into lane ``row``: as
    fold does in the eight-row order, bit for bit."""
    from numba import njit

    from meshnode.engine.cpu.simd import vstore, wload, wstore

    sb = order(four, monkeypatch)

    @njit(cache=False)
    def moved(v, a, b, out, rows):  # type: ignore[no-untyped-def]
        wstore(out, 0, sb.klanes(wload(v, 0)))
        wstore(out, 16, sb.kpair(a, b))
        vstore(rows, 0, sb.krows(sb.klanes(wload(v, 0))))

    v = rng.standard_normal(16).astype(np.float32)
    out, rows = np.zeros(32, np.float32), np.zeros(8, np.float32)
    moved(v, np.float32(1.5), np.float32(-2.0), out, rows)
    pair = np.repeat(np.array([1.5, -2.0], np.float32), 8)
    np.testing.assert_array_equal(out[:16], v[ORDER] if four else v)
    np.testing.assert_array_equal(out[16:], pair[ORDER] if four else pair)
    np.testing.assert_array_equal(rows, v[:8] + v[8:])


def scale_min(q: np.ndarray, s: int) -> tuple[int, int]:
    """GGML's get_scale_min_k4: scale and minimum s of a Q4_K super-block's 12 bytes."""
    if s < 4:
        return int(q[s] & 63), int(q[s + 4] & 63)
    return int((q[s + 4] & 15) | ((q[s - 4] >> 6) << 4)), int((q[s + 4] >> 4) | ((q[s] >> 6) << 4))


@pytest.mark.parametrize("four", ORDERS, ids=["eight-row", "four-row"])
def test_q4_k_scales_of_eight_rows_in_either_order(
    four: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q4_k_scales8: ``d sc`` and ``-dmin mn`` of each chunk pair, the float32 products of
    every six-bit scale and minimum with the float16 factors, in the lanes of the order
    it was compiled for."""
    from numba import njit

    from meshnode.engine.cpu.simd import wstore

    sb = order(four, monkeypatch)

    @njit(cache=False)
    def scales(w, bases, o, out):  # type: ignore[no-untyped-def]
        at = (bases[0], bases[1], bases[2], bases[3], bases[4], bases[5], bases[6], bases[7])
        v = sb.q4_k_scales8(w, at, o)
        for i in range(8):
            wstore(out, 16 * i, v[i])

    bases = np.array([0, 144, 300, 451, 600, 760, 900, 1050], np.int64)
    w = rng.integers(0, 256, 1250).astype(np.uint8)
    heads = rng.uniform(-2, 2, (8, 2)).astype(np.float16)
    heads[0] = [np.inf, -0.0]  # converted as they are
    for b, h in zip(bases, heads, strict=True):
        w[b + 5 : b + 9] = h.view(np.uint8)
    out = np.zeros(128, np.float32)
    scales(w, bases, 5, out)
    want = np.zeros((8, 16), np.float32)
    for j, b in enumerate(bases):
        d, dmin = np.float32(heads[j, 0]), -np.float32(heads[j, 1])
        for c in range(8):
            sc, mn = scale_min(w[b + 9 : b + 21], c)
            want[c // 2, 8 * (c % 2) + j] = d * np.float32(sc)
            want[4 + c // 2, 8 * (c % 2) + j] = dmin * np.float32(mn)
    got = out.reshape(8, 16)
    np.testing.assert_array_equal(got, want[:, ORDER] if four else want)


@pytest.mark.parametrize("four", ORDERS, ids=["eight-row", "four-row"])
def test_q6_k_chunk_pair_sums_are_exact_in_either_order(
    four: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q6_K chunk pair of eight rows through the step's integer path: each row's
    ``(u - 32) x`` dots, its sixteen int8 scales (each half of a chunk times its own:
    by q6_dot in the eight-row order, by kscale on four rows' sums in the four-row one),
    summed across the rows by ksum: exact, in the lanes of the order compiled for."""
    from numba import njit

    from meshnode.engine.cpu import q8_q6_k as q6
    from meshnode.engine.cpu.simd_int import bload
    from meshnode.engine.cpu.simd_q8 import join64, store16

    sb = order(four, monkeypatch)

    @njit(cache=False)
    def sums(w, bases, u, x, out):  # type: ignore[no-untyped-def]
        at = (bases[0], bases[1], bases[2], bases[3], bases[4], bases[5], bases[6], bases[7])
        ss = q6.q6_k_scales8(w, at, 1, 2)  # chunks 2, 3: scales 4 .. 7
        t0, t1 = q6.q6_k_scales4(w, at, 1, 2)
        p0 = q6.kq6(join64(bload(u, 0), bload(u, 32)), x, 0, ss[0])
        p1 = q6.kq6(join64(bload(u, 64), bload(u, 96)), x, 0, ss[1])
        p2 = q6.kq6(join64(bload(u, 128), bload(u, 160)), x, 0, ss[2])
        p3 = q6.kq6(join64(bload(u, 192), bload(u, 224)), x, 0, ss[3])
        p4 = q6.kq6(join64(bload(u, 256), bload(u, 288)), x, 0, ss[4])
        p5 = q6.kq6(join64(bload(u, 320), bload(u, 352)), x, 0, ss[5])
        p6 = q6.kq6(join64(bload(u, 384), bload(u, 416)), x, 0, ss[6])
        p7 = q6.kq6(join64(bload(u, 448), bload(u, 480)), x, 0, ss[7])
        p03 = q6.kscale(sb.ksum(sb.ksum(p0, p1, 1), sb.ksum(p2, p3, 1), 2), t0)
        p47 = q6.kscale(sb.ksum(sb.ksum(p4, p5, 1), sb.ksum(p6, p7, 1), 2), t1)
        store16(out, 0, sb.ksum(p03, p47, 3))

    bases = np.array([0, 20, 41, 60, 83, 100, 124, 140], np.int64)
    for u, x, scales in _q6_cases(rng):
        w = np.zeros(160, np.uint8)
        for j, b in enumerate(bases):
            w[b + 1 : b + 17] = np.asarray(scales[j], np.int8).view(np.uint8)
        u8, x8 = np.asarray(u, np.uint8), np.asarray(x, np.int8)
        out = np.zeros(16, np.int32)
        sums(w, bases, u8.reshape(-1), x8.view(np.uint8), out.view(np.uint8))
        halves = ((u8.astype(np.int64) - 32) * x8).reshape(8, 4, 16).sum(2)
        scaled = halves * np.asarray(scales, np.int64)[:, 4:8]
        want = np.concatenate([scaled[:, 0] + scaled[:, 1], scaled[:, 2] + scaled[:, 3]])
        np.testing.assert_array_equal(out, want[ORDER] if four else want)


@pytest.mark.parametrize("c", [2, 4])
def test_q6_k_rows4_gives_the_four_row_sums_of_a_chunk_pair(
    c: int, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q6_k_rows4, AVX2's whole chunk pair of eight Q6_K rows from their super-blocks'
    bytes (its sums across four rows in int16, the scales by vpmaddwd): the same integers
    as the test above, in the four-row order, at the bounds of its int16 sums too."""
    from numba import njit

    from meshnode.engine.cpu import q8_q6_k as q6
    from meshnode.engine.cpu.simd_q8 import store16

    order(True, monkeypatch)

    @njit(cache=False)
    def sums(w, bases, x, out, c):  # type: ignore[no-untyped-def]
        at = (bases[0], bases[1], bases[2], bases[3], bases[4], bases[5], bases[6], bases[7])
        if c == 2:
            store16(out, 0, q6.q6_k_rows4(w, at, 0, 2, x, 64))
        else:
            store16(out, 0, q6.q6_k_rows4(w, at, 0, 4, x, 64))

    h, m = c // 4, c % 4
    bases = np.array([0, 210, 430, 640, 850, 1070, 1280, 1500], np.int64)
    for u, x, scales in [
        *_q6_cases(rng),
        (np.zeros((8, 64)), np.full(64, -127), np.full((8, 16), -128)),
    ]:
        u8 = np.asarray(u, np.uint8)
        w = np.zeros(1710, np.uint8)
        for j, b in enumerate(bases):  # row j's super-block: chunks c, c + 1 are u8[j]
            ql = (u8[j] & 15) << (2 * m)
            w[b + 64 * h : b + 64 * h + 64] = ql
            qh = ((u8[j, :32] >> 4) << (2 * m)) | ((u8[j, 32:] >> 4) << (2 * m + 2))
            w[b + 128 + 32 * h : b + 160 + 32 * h] = qh
            w[b + 192 : b + 208] = np.asarray(scales[j], np.int8).view(np.uint8)
        x8 = np.zeros(128, np.int8)
        x8[64:] = x
        out = np.zeros(16, np.int32)
        sums(w, bases, x8.view(np.uint8), out.view(np.uint8), c)
        halves = ((u8.astype(np.int64) - 32) * x8[64:]).reshape(8, 4, 16).sum(2)
        scaled = halves * np.asarray(scales, np.int64)[:, 2 * c : 2 * c + 4]
        want = np.concatenate([scaled[:, 0] + scaled[:, 1], scaled[:, 2] + scaled[:, 3]])
        np.testing.assert_array_equal(out, want[ORDER])


def _q6_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Eight Q6_K rows' 6-bit values, 64 activation bytes and the rows' 16 scales: random,
    then the extremes of the int16 sums (all zero against +127 and -128 scales, all 63
    against -127 and +127)."""
    return [
        (
            rng.integers(0, 64, (8, 64)),
            rng.integers(-127, 128, 64),
            rng.integers(-128, 128, (8, 16)),
        ),
        (np.zeros((8, 64)), np.full(64, 127), np.full((8, 16), -128)),
        (np.full((8, 64), 63), np.full(64, -127), np.full((8, 16), 127)),
    ]
