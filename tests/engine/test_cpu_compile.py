"""What a first start compiles: the kernels of the formats a model has, once each.

numba compiles every branch a function's types reach, so a kernel that chose its block
decoder with a runtime ``if fmt == ...`` compiled all thirteen formats' decoders for each
product; and it compiles a function again for each new argument type (a writable array
beside a read-only one, a literal ``0`` beside an ``int64``). The check runs in a fresh
process on an empty ``NUMBA_CACHE_DIR``, where nothing is loaded from a cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from meshnode.engine.cpu import kernels
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.wide import wchunk
from tests.conftest import REPO_ROOT

# Products of 1, 2, 3 and 20 rows, serial and on the kernel threads, of a matrix and of a
# fused Q/K/V-like one of two formats, and the embedding's row gather: everything a
# model of Q4_1 and Q8_0 weights (SmolLM2's) asks of the kernels; each compiled function
# listed with the argument types of each compile (numba's compile events).
_DECODERS = [f.exact.rsplit(".", 1)[1] for f in FORMATS.values()]
_PREAMBLE = """
import collections, json, sys
from pathlib import Path
import numpy as np
from numba.core import event
from tests.engine.test_cpu_kernels import N_IN, random_tensor
from meshnode.engine.cpu import BlockMatrix, matrix, q8
from meshnode.engine.cpu.pool import CoreGauge, KernelPool

rng = np.random.default_rng(3)
q41, q80 = random_tensor("Q4_1", 70, rng), random_tensor("Q8_0", 40, rng)
idle = KernelPool(CoreGauge(Path(sys.argv[1]) / "no-stat", cpus={0, 1, 2, 3}))
matrix._pool = lambda: idle
matrix.PARALLEL_MIN_BYTES = 0
with event.install_recorder("numba:compile") as rec:
"""
_EPILOGUE = """
compiled = collections.defaultdict(list)  # module.function: the argument types of each compile
for _, ev in rec.buffer:
    if ev.is_start:
        fn = ev.data["dispatcher"].py_func
        compiled[fn.__module__ + "." + fn.__name__].append(str(ev.data["args"]))
print(json.dumps({"posted": idle.posted, "compiled": compiled}))
"""
_PRODUCTS = """
for m in (BlockMatrix([q41]), BlockMatrix([q41, q80, q41])):
    for threads in (1, 2):
        matrix.set_kernel_threads(threads)
        for k in (1, 2, 3, 20):
            rng.standard_normal((k, N_IN)).astype(np.float32) @ m
BlockMatrix([q80]).rows([3, 1])
"""


def compiled_in_fresh_process(tmp_path: Path, work: str) -> dict[str, Any]:
    """Run ``work`` (Python, with Q4_1/Q8_0 tensors ``q41``/``q80``, ``rng``, ``matrix``,
    ``q8`` and ``BlockMatrix`` at hand, the kernel threads' pool forced on) in a fresh
    process on an empty numba cache: ``{"posted": pool jobs, "compiled": {module.function:
    [argument types of each compile]}}`` from numba's compile events."""
    script = _PREAMBLE + textwrap.indent(textwrap.dedent(work), "    ") + _EPILOGUE
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    result: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    return result


# the k-row passes of Q4_1 and Q8_0, by the tile form (kernels.tile_form)
_NARROW = "meshnode.engine.cpu.narrow."
_K_ROWS = {
    8: (_NARROW + "k_rows", _NARROW + "k_rows_q8_0"),
    16: ("meshnode.engine.cpu.panels.k_rows",),
}


def test_a_model_compiles_its_own_formats_once_each(tmp_path: Path) -> None:
    """Only the Q4_1 and Q8_0 decoders are compiled, none of the other formats'; the
    one-row passes and the k-row tiles once per format, not per format mix, array type or
    caller (the serial products pass them the model's read-only memory, the kernel
    threads' chunks an address); the pool's claim loop once."""
    got = compiled_in_fresh_process(tmp_path, _PRODUCTS)
    assert got["posted"] > 0  # the kernel threads' chunks were compiled and ran
    compiled = got["compiled"]
    decoders = [name for name in compiled if name.rsplit(".", 1)[1] in _DECODERS]
    assert sorted(d.rsplit(".", 1)[1] for d in decoders) == ["_q4_1", "_q8_0"]
    for passes in (("meshnode.engine.cpu.passes.pass4_blocks",), _K_ROWS[kernels.tile_form()]):
        # (fmt, form, many, ...): once per format, for its row kind
        calls = [args for name in passes for args in compiled.get(name, [])]
        assert sorted(args.split(",")[0] for args in calls) == [
            f"(Literal[int]({fmt})" for fmt in (4, 7)
        ], passes
    assert (
        len(compiled["meshnode.engine.cpu.pool_words._claim_and_run"]) == 1
    )  # the caller's and the helpers' alike


def test_one_row_products_compile_no_k_row_tiles(tmp_path: Path) -> None:
    """A node that multiplies one activation row at a time (one stream's decode, a long
    prompt's last row) compiles the one-row passes only: the k rows' tiles (.narrow's,
    the sixteen-lane ones) wait for the first product of two to sixteen rows."""
    got = compiled_in_fresh_process(
        tmp_path,
        """
        for m in (BlockMatrix([q41]), BlockMatrix([q41, q80, q41])):
            for threads in (1, 2):
                matrix.set_kernel_threads(threads)
                rng.standard_normal((1, N_IN)).astype(np.float32) @ m
        """,
    )
    assert got["posted"] > 0
    compiled = got["compiled"]
    assert not {name for names in _K_ROWS.values() for name in names} & set(compiled)
    assert "meshnode.engine.cpu.passes.pass4_blocks" in compiled


def test_q8_products_compile_their_chunk_functions_only(tmp_path: Path) -> None:
    """An 8-bit product in one thread runs the kernel threads' chunk function alone
    (``q8_alone.alone``): no serial product function compiles beside it, and a model
    without MXFP4 weights compiles none of MXFP4's two-row code."""
    got = compiled_in_fresh_process(
        tmp_path,
        """
        m = BlockMatrix([q41, q80, q41])
        for threads in (1, 2):
            matrix.set_kernel_threads(threads)
            for k in (1, 3):
                q8.q8_product(m, rng.standard_normal((k, N_IN)).astype(np.float32))
        """,
    )
    compiled = got["compiled"]
    assert len(compiled["meshnode.engine.cpu.q8_kernels._rows"]) == 2  # Q4_1, Q8_0
    assert len(compiled["meshnode.engine.cpu.q8_alone.alone"]) == 1
    serial = "meshnode.engine.cpu.q8_kernels.product"  # named per formats: product__...
    assert not [name for name in compiled if name.startswith(serial)]
    assert not [name for name in compiled if "mxfp4" in name]


def test_a_format_known_only_at_run_time_is_refused() -> None:
    """A format passed as a run-time integer would compile every decoder: refused while
    compiling, with the reason."""

    @njit
    def first_chunk(fmt, row):  # type: ignore[no-untyped-def]
        return wchunk(fmt, row, 0)

    with pytest.raises(TypingError, match="compile-time constant"):
        first_chunk(4, np.zeros(20, np.uint8))
