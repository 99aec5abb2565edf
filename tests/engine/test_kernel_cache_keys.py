"""The compiled kernels made per format (closures) load from numba's disk cache at the
next start, each as itself.

numba keys a closure's cache entry by a hash of its captured values, so each must pickle
the same in every process. A captured numba dispatcher does not (its pickle carries an id
new to each process): the q8 products captured ``_rows`` and were compiled again at every
start (5-10 s of CPU on a warm q8 start). The first tests make the closures without
compiling them.

And each variant has its own name (:mod:`.variants`): numba names a compiled function by
its qualified name, argument types and a number counted in the compiling process, so
two variants compiled in two processes could share a symbol, and a kernel loaded from the
cache then ran the other variant's code (NaN from the exact mixture-of-experts kernels in
two CI runs). The last test rebuilds that collision in two fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.engine.cpu import attention, experts_kernels, kernels, q8_kernels, tiles
from meshnode.engine.cpu.formats import FORMATS
from tests.conftest import REPO_ROOT

Q4_K, Q8_0 = FORMATS["Q4_K"].kernel_id, FORMATS["Q8_0"].kernel_id


def _function(kernel: Any) -> Any:
    # a cfunc, a dispatcher, or a function numba compiles later (attention's chunk)
    return getattr(kernel, "_pyfunc", None) or getattr(kernel, "py_func", kernel)


KERNELS = [
    q8_kernels._serial_product(Q4_K, Q8_0, Q4_K, False),
    q8_kernels._serial_product(Q4_K, Q4_K, Q4_K, True),
    q8_kernels._chunk_product(Q4_K, Q8_0, Q4_K, False),
    q8_kernels._chunk_product(Q4_K, Q4_K, Q4_K, True),
    kernels._serial_product(Q4_K, Q8_0, Q4_K, 8, kernels.ONE_ROW),
    kernels._chunk_product(Q4_K, Q8_0, Q4_K, 16, kernels.K_ROWS),
    tiles._decode_kernel(Q8_0),
    tiles.decoder.__wrapped__(Q8_0),
    experts_kernels.experts_kernel.__wrapped__((Q4_K, Q4_K, Q4_K, True), (Q8_0, Q8_0, Q8_0, False)),
]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_kernel_closure_captures_plain_values_only(kernel: Any) -> None:
    fn = _function(kernel)
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    assert cells, "a kernel made per format captures its format ids"
    assert all(type(v) in (int, bool) for v in cells), (fn.__qualname__, cells)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_kernel_closure_is_named_by_its_captured_values(kernel: Any) -> None:
    fn = _function(kernel)
    values = [int(c.cell_contents) for c in fn.__closure__ or ()]
    base, _, suffix = fn.__qualname__.rpartition("__")
    assert base.endswith(fn.__code__.co_name), fn.__qualname__
    assert fn.__name__ == f"{fn.__code__.co_name}__{suffix}"
    assert sorted(int(v) for v in suffix.split("_")) == sorted(values), (fn.__qualname__, values)


def test_two_variants_have_two_names() -> None:
    """The pairs that differ in one value only: a format, the tile form, the row count,
    the tiled q8 pass, the experts' q8 flag, the attention caches' kind."""
    pairs = [
        (kernels._serial_product(Q4_K, Q8_0, Q4_K, 8, kernels.ONE_ROW),
         kernels._serial_product(Q4_K, Q8_0, Q8_0, 8, kernels.ONE_ROW)),
        (kernels._chunk_product(Q4_K, Q8_0, Q4_K, 8, kernels.K_ROWS),
         kernels._chunk_product(Q4_K, Q8_0, Q4_K, 16, kernels.K_ROWS)),
        (kernels._serial_product(Q8_0, Q8_0, Q8_0, 8, kernels.ONE_ROW),
         kernels._serial_product(Q8_0, Q8_0, Q8_0, 8, kernels.ANY_ROWS)),
        (q8_kernels._serial_product(Q4_K, Q4_K, Q4_K, False),
         q8_kernels._serial_product(Q4_K, Q4_K, Q4_K, True)),
        (experts_kernels.experts_kernel.__wrapped__((Q4_K, Q4_K, Q4_K, 0), (Q8_0, Q8_0, Q8_0, 0)),
         experts_kernels.experts_kernel.__wrapped__((Q4_K, Q4_K, Q4_K, 1), (Q8_0, Q8_0, Q8_0, 0))),
        (attention._chunk_function(np.uint16(0)), attention._chunk_function(np.float32(0))),
    ]  # fmt: skip
    for one, other in pairs:
        assert _function(one).__qualname__ != _function(other).__qualname__


# Two processes on one empty cache. The first compiles the exact experts of float32 weights
# (the product of three F32 parts linked into them) and runs them; the second compiles the
# product of F16 parts for the same argument types, first, under the number the first
# process gave the F32 product, then loads the experts from the cache and runs them on the
# same rows. Before .variants both products were one symbol, and the loaded experts ran
# the F16 code on F32 weights: NaN.
_COLLIDE = """
import itertools, json, pickle, sys
import numpy as np
from numba.core import bytecode
from meshnode.engine.cpu import matrix
matrix.lock_numba_cache()
from meshnode.engine.cpu import experts_kernels, kernels
from meshnode.engine.cpu.formats import FORMATS

F32, F16 = FORMATS["F32"].kernel_id, FORMATS["F16"].kernel_id
rng = np.random.default_rng(0)
E, I, n = 64, 32, 2  # width, expert size, experts
gate_up = rng.standard_normal((n, 2 * I, E)).astype(np.float32).view(np.uint8)
down = rng.standard_normal((n, E, I)).astype(np.float32).view(np.uint8)
x = rng.standard_normal((3, E)).astype(np.float32)

def experts():
    # rows 0 and 2 to expert 1, row 1 to expert 0 (one expert a row)
    none = np.zeros((n, 0, 4 * E), np.uint8), np.zeros((n, 0, 4 * I), np.uint8)
    ys = np.zeros((3, E), np.float32)
    kernel = experts_kernels.experts_kernel((F32, F32, F32, 0), (F32, F32, F32, 0))
    kernel(gate_up, none[0], none[0], down, none[1], none[1], np.zeros((n, 0), np.float32),
           np.zeros((n, 0), np.float32), 0, 0.0, 0.0, x, np.array([0, 1]), np.array([0, 1, 3]),
           np.array([1, 0, 2]), 1, ys)
    return ys

product = kernels.product_kernel(F32, F32, F32)
folder = sys.argv[2]
if sys.argv[1] == "first":
    np.save(folder + "/want.npy", experts())
    (signature, compiled), = product.overloads.items()
    with open(folder + "/signature.pkl", "wb") as f:
        pickle.dump(signature, f)
    print(json.dumps({"uid": compiled.fndesc.uid}))
else:
    with open(folder + "/signature.pkl", "rb") as f:
        signature = pickle.load(f)
    bytecode.FunctionIdentity._unique_ids = itertools.count(int(sys.argv[3]))
    other = kernels.product_kernel(F16, F16, F16)
    other.compile(signature)
    got, want = experts(), np.load(folder + "/want.npy")
    print(json.dumps({"equal": bool(np.array_equal(got, want)), "nan": bool(np.isnan(got).any())}))
"""


def test_a_variant_loaded_from_the_cache_runs_its_own_code(tmp_path: Path) -> None:
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "OPENBLAS_NUM_THREADS": "1"}

    def run(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", _COLLIDE, *args],
            capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return result

    uid = run("first", str(tmp_path))["uid"]
    assert run("second", str(tmp_path), str(uid)) == {"equal": True, "nan": False}
