"""What a first start compiles: the kernels of the formats a model has, once each.

numba compiles every branch a function's types reach, so a kernel that chose its block
decoder with a runtime ``if fmt == ...`` compiled all thirteen formats' decoders for each
product; and it compiles a function again for each new argument type (a writable array
beside a read-only one, a literal ``0`` beside an ``int64``). Each check runs in a fresh
process on an empty ``NUMBA_CACHE_DIR``, where nothing is loaded from a cache and
numba's dispatchers list exactly what was compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from meshnode.engine.cpu.wide import wchunk
from tests.conftest import REPO_ROOT

# Products of 1, 2 and 3 rows, serial and on the kernel threads, a fused Q/K/V-like
# matrix of two formats, the embedding's row gather and prefill's tiles: everything a
# model of Q4_1 and Q8_0 weights (SmolLM2's) asks of the kernels.
_SCRIPT = """
import json, sys
from pathlib import Path
import numpy as np
from tests.engine.test_cpu_kernels import N_IN, random_tensor
from meshnode.engine.cpu import BlockMatrix, matrix
from meshnode.engine.cpu import blocks, kernels, wide
from meshnode.engine.cpu.pool import CoreGauge, KernelPool

rng = np.random.default_rng(3)
q41, q80 = random_tensor("Q4_1", 70, rng), random_tensor("Q8_0", 40, rng)
idle = KernelPool(CoreGauge(Path(sys.argv[1]) / "no-stat", cpus={0, 1, 2, 3}))
matrix._pool = lambda: idle
matrix.PARALLEL_MIN_BYTES = 0
for m in (BlockMatrix([q41]), BlockMatrix([q41, q80, q41])):
    for threads in (1, 2):
        matrix.set_kernel_threads(threads)
        for k in (1, 2, 3, 20):
            rng.standard_normal((k, N_IN)).astype(np.float32) @ m
BlockMatrix([q80]).rows([3, 1])
decoders = {fmt: len(d.signatures) for fmt, d in wide._DECODERS.items()}
floats = {fmt: len(d.signatures) for fmt, d in blocks._FLOATS.items()}
helpers = {
    name: [str(s) for s in getattr(kernels, name).signatures]
    for name in ("_rows", "_dot1_wide", "_decode_wide", "_dot4x4")
}
print(json.dumps({"posted": idle.posted, "decoders": decoders, "floats": floats} | helpers))
"""


def _compiled(tmp_path: Path) -> dict[str, Any]:
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    result: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    return result


def test_a_model_compiles_its_own_formats_once_each(tmp_path: Path) -> None:
    """Only the Q4_1 and Q8_0 decoders are compiled (each once), none of the other
    eleven formats'; ``_rows`` once per format although the serial products pass it the
    model's read-only memory and the kernel threads' chunks an address; the 4 x 4 tile
    once for every product."""
    got = _compiled(tmp_path)
    assert got["posted"] > 0  # the kernel threads' chunks were compiled and ran
    q41, q80 = "4", "7"  # .formats.FORMATS' kernel ids
    assert got["decoders"] == {f: int(f in (q41, q80)) for f in got["decoders"]}
    assert got["floats"] == {"0": 0, "1": 0, "2": 0}
    formats = sorted(s.split(",")[0] for s in got["_rows"])
    assert formats == ["(Literal[int](4)", "(Literal[int](7)"]
    assert len(got["_dot1_wide"]) == len(got["_decode_wide"]) == 2
    assert len(got["_dot4x4"]) == 1


def test_a_format_known_only_at_run_time_is_refused() -> None:
    """A format passed as a run-time integer would compile every decoder: refused while
    compiling, with the reason."""

    @njit
    def first_chunk(fmt, row):  # type: ignore[no-untyped-def]
        return wchunk(fmt, row, 0)

    with pytest.raises(TypingError, match="compile-time constant"):
        first_chunk(4, np.zeros(20, np.uint8))
