"""benchmarks/compile_times.py: each numba compile gets its own seconds, its callees'
apart, cfunc kernels included, and the listeners go when the block ends."""

from __future__ import annotations

import numpy as np
from numba import cfunc, njit, types

from benchmarks.compile_times import install, repeats, stages, table


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
    signatures = {r["function"].rsplit(".", 1)[-1]: r["signature"] for r in recorder.records}
    assert signatures["callee"] == "(float64)"  # what tells one function's compiles apart
    assert "array(float64, 1d, C)" in signatures["caller"]
    assert signatures["body"] == "(float64)"
    for r in recorder.records:
        assert 0.0 <= r["llvm"] <= r["seconds"] + 1e-3
    # each stage of compiling was timed, its own seconds (the nested stages' apart)
    # within the compiles' seconds
    for stage in ("type inference", "numba lowering", "LLVM module passes", "LLVM machine code"):
        assert recorder.stages[stage] > 0.0, stage
    assert sum(recorder.stages.values()) <= sum(r["seconds"] for r in recorder.records) + 1e-3
    assert stages([recorder.stages]).startswith("by stage (s): ")
    lines = table([recorder.records], top=2)
    assert lines[0].startswith("compiling: ")
    assert len(lines) == 4 + 2  # the header, the table's two header lines, two rows

    # after the block, compiles are not recorded
    @njit
    def later(x):  # type: ignore[no-untyped-def]
        return x + 1

    before = dict(recorder.stages)
    assert later(1) == 2
    assert "later" not in {r["function"].rsplit(".", 1)[-1] for r in recorder.records}
    assert recorder.stages == before  # numba's methods are its own again


def test_repeats_lists_the_argument_types_of_each_compile_of_a_function() -> None:
    records = [
        {"function": "m.f", "seconds": 1.0, "llvm": 0.5, "signature": "(int64)"},
        {"function": "m.g", "seconds": 1.0, "llvm": 0.5, "signature": "(int64)"},
        {"function": "m.f", "seconds": 1.0, "llvm": 0.5, "signature": "(int32)"},
    ]
    assert repeats(records) == ["- m.f, 2 compiles:", "  - `(int64)`", "  - `(int32)`"]
