"""A row's logits are the same bits on one thread or two, on an idle machine or with
both cores busy, alone and in a batch of eight (issue 35: the answer depended on the
load and on the batch).

Every run is compared with the first, alone and batched alike: the kernels sum each
output element in one order whether they multiply one activation row or several
(:mod:`.kernels`), so a decode row alone and the same row in a batch of eight are the
same bits. ``test_cpu_tiles.py`` checks the rest of it: a long segment's rows are the
same bits in any batch.

The model is the independent reference's tiny Qwen3 (``tests/golden/tiny/qwen3-tiny``),
held in its own float32 "blocks" (the default, ``native``): prompts of 3 to 300 tokens
take both paths of a product (the kernel for a few rows, tiles through BLAS for many)
and both of attention (the kernel, blocked BLAS for a long segment).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CpuBackend, WeightsDtype
from meshnode.engine.cpu import matrix
from meshnode.engine.cpu.pool import KernelPool
from meshnode.engine.model import BatchRow
from tests.engine.test_kernel_pool import idle_gauge

QWEN3_TINY = Path(__file__).parents[1] / "golden" / "tiny" / "qwen3-tiny"
DECODE_STEPS = 3
# How long a busy loop spins at most, should its test die before killing it.
BUSY_SECONDS = 300

Logits = list[np.ndarray]  # per prompt: [1 + DECODE_STEPS, V]


def prompts() -> list[list[int]]:
    """The reference's four prompts (5, 17, 40 and 300 tokens) and four cut from the
    longest: eight, of lengths on both sides of every path's row limit."""
    golden = json.loads((QWEN3_TINY / "golden.json").read_text())
    given = [p["prompt_ids"] for p in golden["prompts"]]
    longest = max(given, key=len)
    return [*given, longest[:3], longest[:16], longest[:24], longest[:90]]


def whole_stage(weights_dtype: WeightsDtype) -> Stage:
    """The tiny Qwen3 as one stage on the CPU, its weights in ``weights_dtype``."""
    source = open_source(QWEN3_TINY)
    config = ModelConfig.from_hf(source.config)
    backend = CpuBackend(weights_dtype=weights_dtype)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)


@pytest.fixture(scope="module")
def stage() -> Stage:
    return whole_stage("native")


def solo(stage: Stage, ids: list[int]) -> np.ndarray:
    """The last prompt row's logits, then DECODE_STEPS greedy steps', one sequence."""
    cache = stage.new_cache(len(ids) + DECODE_STEPS + 1)
    rows = [stage.forward(np.array(ids), 0, cache, out_rows=1)[-1]]
    for _ in range(DECODE_STEPS):
        token = int(np.argmax(rows[-1]))
        rows.append(stage.forward(np.array([token]), cache.length, cache, out_rows=1)[-1])
    return np.stack(rows)


def batched(stage: Stage, all_ids: list[list[int]]) -> Logits:
    """As :func:`solo` for every prompt, all of them in each forward."""
    caches = [stage.new_cache(len(ids) + DECODE_STEPS + 1) for ids in all_ids]
    items = [BatchRow(np.array(ids), 0, c, 1) for ids, c in zip(all_ids, caches, strict=True)]
    rows = [[out[-1]] for out in stage.forward_batch(items)]
    for _ in range(DECODE_STEPS):
        items = [
            BatchRow(np.array([int(np.argmax(r[-1]))]), c.length, c, 1)
            for r, c in zip(rows, caches, strict=True)
        ]
        for r, out in zip(rows, stage.forward_batch(items), strict=True):
            r.append(out[-1])
    return [np.stack(r) for r in rows]


def runs(stage: Stage, threads: int, label: str) -> dict[str, dict[str, Logits]]:
    """Every prompt alone, and all in one batch, with ``threads`` kernel threads; with
    two, once more with the pool sure of four free cores (so its helpers take chunks
    and tiles whatever the load)."""
    all_ids = prompts()
    got: dict[str, dict[str, Logits]] = {"alone": {}, "batch of 8": {}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matrix, "_threads", threads)
        got["alone"][f"{label}, {threads} thread(s)"] = [solo(stage, ids) for ids in all_ids]
        got["batch of 8"][f"{label}, {threads} thread(s)"] = batched(stage, all_ids)
        if threads > 1:
            pool = KernelPool(idle_gauge(4))
            mp.setattr(matrix, "_pool", lambda: pool)
            name = f"{label}, {threads} threads on 4 'free' cores"
            got["batch of 8"][name] = batched(stage, all_ids)
            got["alone"][name] = [solo(stage, ids) for ids in all_ids]
    return got


def assert_all_equal(*runs_: dict[str, dict[str, Logits]]) -> None:
    """Every run's logits, alone and in a batch of 8, equal the first's (alone)."""
    got = {f"{mode}, {name}": v for r in runs_ for mode in r for name, v in r[mode].items()}
    (first, want), *rest = got.items()
    assert len(rest) >= 3
    for name, logits in rest:
        for i, (a, b) in enumerate(zip(want, logits, strict=True)):
            differ = int(np.count_nonzero(a != b))
            assert differ == 0, f"prompt {i}: {name} != {first} in {differ} logits"


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """Two processes spinning, one per core of this machine's two, until the test ends
    (at most BUSY_SECONDS); the test starts once both spin."""
    code = (
        "import sys, time\nprint('spinning', flush=True)\nend = time.monotonic() + "
        f"{BUSY_SECONDS}\nwhile time.monotonic() < end: pass"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in "ab"]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline() == b"spinning\n"
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def test_logits_are_the_same_bits_on_any_thread_count(stage: Stage) -> None:
    assert_all_equal(runs(stage, 1, "idle"), runs(stage, 2, "idle"))


@pytest.mark.usefixtures("busy_cores")
def test_logits_are_the_same_bits_with_both_cores_busy(stage: Stage) -> None:
    assert_all_equal(runs(stage, 1, "busy"), runs(stage, 2, "busy"))
