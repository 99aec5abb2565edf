"""``--dtype float32``: a row's logits are the same bits alone and in a batch of eight, on
one thread or two, idle or with both cores busy (issue 35).

Dense float32 products used to be ``x @ w`` as NumPy hands it to BLAS: a one-row gemv
alone, an sgemm whose kernel OpenBLAS picks by the row count in a batch, and BLAS's own
threads. They now take a path fixed by the segment's rows
(:func:`meshnode.engine.cpu.dense_product`), as the block formats do.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshnode.engine import Stage
from meshnode.engine.cpu import MAX_KERNEL_ROWS, dense_product, matrix
from tests.engine.test_same_bits import batched, busy_cores, prompts, solo, whole_stage

__all__ = ["busy_cores"]  # the fixture, imported for the busy test


@pytest.fixture(scope="module")
def stage() -> Stage:
    return whole_stage("float32")


@pytest.mark.parametrize(("n_in", "n_out"), [(64, 48), (576, 1536), (2048, 96)])
def test_a_rows_product_is_the_same_bits_in_any_batch(n_in: int, n_out: int) -> None:
    """Segments of 1, 3, 16 (one gemv a row), 17, 40 and 300 rows (sgemm, padded to 128
    columns where the matrix has fewer): each segment alone, and all in one batch."""
    rng = np.random.default_rng(n_in + n_out)
    w = rng.standard_normal((n_in, n_out), dtype=np.float32)
    sizes = [1, 17, 3, MAX_KERNEL_ROWS, 300, 40]
    x = rng.standard_normal((sum(sizes), n_in), dtype=np.float32)
    batch = dense_product(x, w, sizes)
    np.testing.assert_allclose(batch, x @ w, rtol=1e-4, atol=1e-3 * np.sqrt(n_in))
    lo = 0
    for size in sizes:
        alone = dense_product(x[lo : lo + size], w)
        differ = int(np.count_nonzero(alone != batch[lo : lo + size]))
        assert differ == 0, f"a segment of {size} rows differs in {differ} values"
        lo += size
    with pytest.raises(ValueError, match="segments of 2 rows for x of 1"):
        dense_product(x[:1], w, [1, 1])


def logits_alone_and_batched(stage: Stage) -> list[list[np.ndarray]]:
    """Per thread count (1, 2): every prompt alone, then all eight in one batch."""
    got = []
    for threads in (1, 2):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(matrix, "_threads", threads)
            got.append([solo(stage, ids) for ids in prompts()])
            got.append(batched(stage, prompts()))
    return got


def assert_same_bits(stage: Stage) -> None:
    (want, *rest) = logits_alone_and_batched(stage)
    for run, logits in enumerate(rest, 1):
        for i, (a, b) in enumerate(zip(want, logits, strict=True)):
            differ = int(np.count_nonzero(a != b))
            assert differ == 0, f"run {run} (alone/batched x 1/2 threads), prompt {i}: {differ}"


def test_float32_logits_are_the_same_bits_alone_batched_and_on_any_thread_count(
    stage: Stage,
) -> None:
    assert_same_bits(stage)


@pytest.mark.usefixtures("busy_cores")
def test_float32_logits_are_the_same_bits_with_both_cores_busy(stage: Stage) -> None:
    assert_same_bits(stage)
