"""benchmarks/compile_times.py: each numba compile gets its own seconds, its callees'
apart, cfunc kernels included, and the listeners go when the block ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from numba import cfunc, njit, types

from benchmarks.compile_times import install, repeats, stages, table
from meshnode.engine.cpu import warmup
from meshnode.engine.cpu.gauge import usable_cpus
from tests.conftest import REPO_ROOT


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


_A_WORKER = """
import json, sys
from pathlib import Path
from numba import types
from benchmarks.compile_times import _record_workers
from meshnode.engine.cpu import warmup
from tests.engine.ahead_kernels import scaled

files = _record_workers(Path(sys.argv[1]))
started = warmup.start("t", scaled, [(types.float64[::1], types.float64)])
warmup.wait("t")
print(json.dumps({"started": started, "workers": [json.loads(f.read_text()) for f in files]}))
"""


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="a worker needs a second core")
def test_a_compile_ahead_worker_records_its_compiles(tmp_path: Path) -> None:
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}  # empty: it compiles
    env.pop(warmup.SWITCH, None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_A_WORKER), str(tmp_path / "out.json")],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["started"]
    [worker] = result["workers"]
    signatures = {r["function"]: r["signature"] for r in worker["records"]}
    assert signatures["tests.engine.ahead_kernels.scaled"] == "(array(float64, 1d, C), float64)"
    assert worker["stages"]["type inference"] > 0.0
