"""The compiled kernels made per format (closures) load from numba's disk cache at the
next start: numba keys a closure's cache entry by a hash of its captured values, so each
must pickle the same in every process. A captured numba dispatcher does not (its pickle
carries an id new to each process): the q8 products captured ``_rows`` and were compiled
again at every start (5-10 s of CPU on a warm q8 start). No numba compile here: the
closures are made, not called."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.engine.cpu import experts_kernels, kernels, q8_kernels, tiles
from meshnode.engine.cpu.formats import FORMATS

Q4_K, Q8_0 = FORMATS["Q4_K"].kernel_id, FORMATS["Q8_0"].kernel_id


def _function(kernel: Any) -> Any:
    return getattr(kernel, "_pyfunc", None) or kernel.py_func  # a cfunc, or a dispatcher


@pytest.mark.parametrize(
    "kernel",
    [
        q8_kernels._serial_product(Q4_K, Q8_0, Q4_K, False),
        q8_kernels._serial_product(Q4_K, Q4_K, Q4_K, True),
        q8_kernels._chunk_product(Q4_K, Q8_0, Q4_K, False),
        q8_kernels._chunk_product(Q4_K, Q4_K, Q4_K, True),
        kernels._serial_product(Q4_K, Q8_0, Q4_K, 8, kernels.ONE_ROW),
        kernels._chunk_product(Q4_K, Q8_0, Q4_K, 16, kernels.K_ROWS),
        kernels._decode_kernel(Q8_0),
        tiles.decoder.__wrapped__(Q8_0),
        experts_kernels.experts_kernel.__wrapped__(
            (Q4_K, Q4_K, Q4_K, True), (Q8_0, Q8_0, Q8_0, False)
        ),
    ],
)
def test_a_kernel_closure_captures_plain_values_only(kernel: Any) -> None:
    fn = _function(kernel)
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    assert cells, "a kernel made per format captures its format ids"
    assert all(type(v) in (int, bool) for v in cells), (fn.__qualname__, cells)
