"""Compiling the attention kernel ahead in a worker process (``meshnode.engine.cpu.warmup``).

The worker helps only if it compiles exactly the signatures the stage's first calls ask
for (else those calls compile again), fills the same cache this process then loads
from, and never costs correctness: a worker that fails leaves the kernel to compile at
its first call. The checks on an empty cache run in a fresh process (numba reads its
cache folder when first imported); they wait for the workers' exits, never a guessed time.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from meshnode_packaging.sources import open_source
from numba import njit, typeof, types

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.attention import KernelAttention
from meshnode.engine.backend import cpu_backend
from meshnode.engine.cpu import attention as kernel
from meshnode.engine.cpu import warmup
from meshnode.engine.cpu.pool import usable_cpus
from meshnode.engine.kv_cache import kv_numpy_dtype
from tests.conftest import REPO_ROOT
from tests.engine.ahead_kernels import scaled

IDS = [1, 60, 61, 62, 259, 70, 19, 20]
F64 = (types.float64[::1], types.float64)
F32 = (types.float32[::1], types.float64)
two_cores = pytest.mark.skipif(len(usable_cpus()) < 2, reason="a worker needs a second core")


@pytest.mark.parametrize("dtype", ["native", "q8"])
def test_the_predicted_signatures_are_the_ones_a_forward_calls(
    tiny_gguf: Callable[[str], Path],
    dtype: Literal["native", "q8"],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = open_source(tiny_gguf("Q8_0"))
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True,
                  backend=cpu_backend(dtype))  # fmt: skip
    attention = stage._mixer.attention  # type: ignore[attr-defined]
    assert isinstance(attention, KernelAttention)
    predicted = attention.signatures(stage.layers, kv_numpy_dtype(stage.kv_dtype))
    called: list[tuple[Any, ...]] = []
    compiled = kernel.queries

    def spy(*args: Any) -> None:
        called.append(tuple(typeof(a) for a in args))  # type: ignore[no-untyped-call]
        compiled(*args)

    monkeypatch.setattr(kernel, "queries", spy)
    cache = stage.new_cache(32)
    stage.forward(np.array(IDS), 0, cache)  # a short prompt: the kernel's segment
    stage.forward(np.array([90]), len(IDS), cache)  # decode
    assert called, "the forward never called the kernel"
    assert set(called) == set(predicted)
    monkeypatch.undo()
    # its code is in the cache now: a stage built again starts no worker
    assert not attention.compile_ahead(stage.layers, kv_numpy_dtype(stage.kv_dtype))
    assert "attention" not in warmup.pending()


@two_cores
def test_a_failed_worker_leaves_the_kernel_to_compile_at_its_first_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    no_such = (types.unicode_type, types.float64)  # `x * factor` does not type for a str
    assert warmup.start("bad", scaled, [no_such])
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        warmup.wait("bad")
    assert "compiling bad ahead failed" in caplog.text
    assert "TypingError" in caplog.text
    assert warmup.pending() == []
    np.testing.assert_array_equal(scaled(np.ones(3), 2.0), np.full(3, 2.0))


def test_switched_off_no_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(warmup.SWITCH, "0")
    assert not warmup.start("off", scaled, [(types.unicode_type, types.float64)])
    assert warmup.pending() == []
    warmup.wait("off")  # nothing to wait for


_ON_AN_EMPTY_CACHE = """
import json, sys
import numpy as np
from numba.core import event
from meshnode.engine.cpu import warmup
from tests.engine.ahead_kernels import scaled
from tests.engine.test_compile_ahead import F32, F64

# two workers at once, two signatures of one function: numba's cache under the lock
started = [warmup.start("a", scaled, [F64]), warmup.start("b", scaled, [F32])]
again = warmup.start("a", scaled, [F64])  # already running
for key in ("a", "b"):
    warmup.wait(key)
with event.install_recorder("numba:compile") as rec:
    scaled(np.ones(3), 2.0)
    scaled(np.ones(3, np.float32), 2.0)
print(json.dumps({
    "started": started, "again": again, "compiles": len(rec.buffer),
    "hits": sum(scaled.stats.cache_hits.values()), "pending": warmup.pending(),
    "cached": warmup.start("c", scaled, [F64, F32]),
}))
"""


@two_cores
def test_workers_fill_the_cache_this_process_then_loads(tmp_path: Path) -> None:
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path)}  # empty: nothing cached
    env.pop(warmup.SWITCH, None)
    script = textwrap.dedent(_ON_AN_EMPTY_CACHE)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["started"] == [True, True]
    assert not result["again"]
    assert result["compiles"] == 0  # both loaded from what the workers cached
    assert result["hits"] == 2
    assert result["pending"] == []
    assert not result["cached"]  # a later start finds both cached: no worker


def test_the_kernels_code_is_compiled_in_its_chunk_function_alone(
    tiny_gguf: Callable[[str], Path],
) -> None:
    """The serial entry ``queries`` calls the chunk function by its address, so its own
    compile (numba optimizes and emits a function with every function it calls) does not
    take the kernel's code again: a first start compiles the key scores and weighted
    sums once, in the chunk function (docs/performance.md, "First start")."""
    source = open_source(tiny_gguf("Q8_0"))
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True,
                  backend=cpu_backend("q8"))  # fmt: skip
    stage.forward(np.array(IDS), 0, stage.new_cache(32))
    assert kernel.queries.signatures, "the forward never called the kernel"
    fresh = njit(nogil=True)(kernel.queries.py_func)  # numba shows no code loaded from its cache
    for sig in kernel.queries.signatures:
        fresh.compile(sig)
        code = fresh.inspect_llvm(sig)
        assert "write_kv" in code  # its own callees are linked in
        assert "key_scores" not in code
        assert "weighted_values" not in code


_FROM_ELSEWHERE = """
import json
import numpy as np
from numba.core import event
from meshnode.engine.cpu import warmup
from tests.engine.ahead_kernels import scaled
from tests.engine.test_compile_ahead import F64

started = warmup.start("a", scaled, [F64])
warmup.wait("a")
with event.install_recorder("numba:compile") as rec:
    scaled(np.ones(3), 2.0)
print(json.dumps({"started": started, "compiles": len(rec.buffer)}))
"""


@two_cores
def test_the_worker_compiles_this_process_code_from_any_working_directory(
    tmp_path: Path,
) -> None:
    """A working directory that holds another ``meshnode`` (a source checkout) does not
    shadow this process's in the worker (``python -m`` put it first on the worker's path:
    it compiled the other tree's functions, and the first call compiled again)."""
    work, runner = tmp_path / "checkout", tmp_path / "bin"
    (work / "meshnode").mkdir(parents=True)
    (work / "meshnode" / "__init__.py").write_text("raise ImportError('the wrong meshnode')\n")
    # the script's folder is first on its path, as a console script's is; the working
    # directory (the other meshnode) is not on it, and is the worker's to ignore too
    runner.mkdir()
    (runner / "run.py").write_text(textwrap.dedent(_FROM_ELSEWHERE))
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": path}
    env.pop(warmup.SWITCH, None)
    done = subprocess.run(
        [sys.executable, str(runner / "run.py")], env=env, capture_output=True, text=True,
        timeout=300, cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ahead failed" not in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"started": True, "compiles": 0}  # loaded what the worker compiled


def test_every_process_that_compiles_locks_numba_cache(tmp_path: Path) -> None:
    """Not only a process that starts a worker: with compiling ahead off (as on a loaded
    machine, where no worker starts) the first product still makes numba's cache saves
    and loads hold the folder's lock, so two nodes on one machine cannot both give one
    data file to two different kernels."""
    code = textwrap.dedent(
        """
        from numba.core.caching import IndexDataCacheFile
        before = getattr(IndexDataCacheFile.save, "_locked", False)
        from meshnode.engine.cpu import matrix
        matrix.kernels()
        print(before, getattr(IndexDataCacheFile.save, "_locked", False))
        """
    )
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path), warmup.SWITCH: "0"}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
        timeout=240, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["False", "True"]
