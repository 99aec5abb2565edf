"""benchmarks/compile_times.py: each numba compile gets its own seconds, its callees'
apart, cfunc kernels included, and the listeners go when the block ends."""

from __future__ import annotations

import numpy as np
from numba import cfunc, njit, types

from benchmarks.compile_times import install, table


def test_records_each_compile_apart_from_its_callees() -> None:
    @njit
    def callee(x):  # type: ignore[no-untyped-def]
        return x * 2.0 + 1.0

    @njit
    def caller(a):  # type: ignore[no-untyped-def]
        total = 0.0
        for v in a:
            total += callee(v)
        return total

    def body(x):  # type: ignore[no-untyped-def]
        return caller(np.full(3, x))

    with install() as recorder:
        assert caller(np.ones(4)) == 12.0
        kernel = cfunc(types.float64(types.float64))(body)
        assert kernel.address != 0
    names = [r["function"].rsplit(".", 1)[-1] for r in recorder.records]
    assert names.count("callee") == 1  # compiled once, inside caller's compile
    assert names.count("caller") == 1  # the cfunc links it, compiled already
    assert names[-1] == "body"  # the cfunc's own record
    for r in recorder.records:
        assert 0.0 <= r["llvm"] <= r["seconds"] + 1e-3
    lines = table([recorder.records], top=2)
    assert lines[0].startswith("compiling: ")
    assert len(lines) == 4 + 2  # the header, the table's two header lines, two rows

    # after the block, compiles are not recorded
    @njit
    def later(x):  # type: ignore[no-untyped-def]
        return x + 1

    assert later(1) == 2
    assert "later" not in {r["function"].rsplit(".", 1)[-1] for r in recorder.records}
