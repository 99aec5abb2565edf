"""The exact products' two register-tile forms (:func:`.kernels.tile_form`) give the same
bits: 4 x 4 tiles of sixteen-lane vectors (AVX-512's 32 registers) and tiles of two rows,
eight lanes at a time (AVX2's 16). Each output is one FMA chain per lane and a tree sum
whichever form computes it, so a mesh can mix the two kinds of machine.

Both forms are compiled here, on any machine (the choice is only speed), for every
format at 1..16 activation rows; a difference in a single value fails."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshnode.engine.cpu import MAX_KERNEL_ROWS, matrix
from meshnode.engine.cpu.formats import FORMATS
from tests.engine.test_cpu_kernels import N_IN, random_tensor

# three formats a product (its parts a, b, c): fewer compiled kernels, every format
_NAMES = list(FORMATS)
_TRIPLES = [_NAMES[i : i + 3] for i in range(0, len(_NAMES), 3)]


def _parts(names: list[str], rng: np.random.Generator) -> tuple[list[int], list[Any]]:
    # 70, 9 and 6 rows: whole passes of four and a partial one in each part
    ids, raws = [], []
    for name, rows in zip(names + ["F32"] * (3 - len(names)), (70, 9, 6), strict=True):
        t = random_tensor(name, rows, rng)
        ids.append(FORMATS[name].kernel_id)
        raws.append(t.data.reshape(rows, -1))
    return ids, raws


@pytest.mark.parametrize("names", _TRIPLES, ids=["-".join(t) for t in _TRIPLES])
def test_both_tile_forms_give_the_same_bits(names: list[str]) -> None:
    kernels = matrix.kernels()
    rng = np.random.default_rng(29)
    ids, raws = _parts(names, rng)
    sixteen = kernels._serial_product(*ids, 16, kernels.ANY_ROWS)  # 1 and k rows
    eight = kernels._serial_product(*ids, 8, kernels.ANY_ROWS)
    n_out = sum(r.shape[0] for r in raws)
    for k in range(1, MAX_KERNEL_ROWS + 1):
        x = rng.standard_normal(k * N_IN).astype(np.float32)
        x[: 2 * N_IN : 97] *= 1e6  # lanes of very different sizes: an order change shows
        want, got = np.empty((k, n_out), np.float32), np.empty((k, n_out), np.float32)
        sixteen(*raws, x, want)
        eight(*raws, x, got)
        differ = np.count_nonzero(want.view(np.uint32) != got.view(np.uint32))
        assert differ == 0, f"{k} rows: {differ} of {want.size} values differ"
        # and a row of the batch equals that row alone (either form)
        alone = np.empty((1, n_out), np.float32)
        eight(*raws, x[(k - 1) * N_IN :], alone)
        np.testing.assert_array_equal(alone[0].view(np.uint32), got[k - 1].view(np.uint32))


def test_the_form_follows_the_registers_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = matrix.kernels()
    from meshnode.engine.cpu import lookup

    monkeypatch.delenv("MESHNODE_TILE_FORM", raising=False)
    assert kernels.tile_form() == (16 if lookup.permutes() else 8)
    for forced in ("8", "16"):
        monkeypatch.setenv("MESHNODE_TILE_FORM", forced)
        assert kernels.tile_form() == int(forced)


def test_a_product_is_the_same_bits_wherever_its_activations_begin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the kernels read them from a 64-byte line (matrix._lined copies them there; every
    # matrix here, not only those of LINED_MIN_BYTES)
    monkeypatch.setattr(matrix, "LINED_MIN_BYTES", 0)
    rng = np.random.default_rng(31)
    m = matrix.BlockMatrix([random_tensor("Q4_K", 40, rng)])
    values = rng.standard_normal((8, N_IN)).astype(np.float32)
    want = values @ m
    buf = np.zeros(values.size + 16, np.float32)
    for skip in range(16):  # every 4-byte offset into a line, one of them its start
        x = buf[skip : skip + values.size].reshape(values.shape)
        x[:] = values
        assert matrix._lined(x).ctypes.data % 64 == 0
        np.testing.assert_array_equal((x @ m).view(np.uint32), want.view(np.uint32))
