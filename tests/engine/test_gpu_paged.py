"""The CUDA stage over a pool of KV blocks (issue 30), on a device (skipped without one).

The scenarios of ``test_ops_cuda_paged.py`` with the real kernels, CUDA graphs on: a
sequence's blocks scattered over a pool on the device, read and written through its block
table (``kernels.kv_row``, the table's device copy named in the step array), give the bits
of a contiguous cache, alone, batched, captured and replayed with other sequences'
tables; a prefix one sequence stored is resumed by reference by another, and a rollback
into a shared block copies it first (``BlockPool.copy`` on the caller's stream,
synchronized before the stage's stream runs the next forward).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import ModelConfig, Stage
from meshnode.node.prefix import StagePrefix, pool_blocks
from tests.engine.test_gpu_kernels import cuda_backend
from tests.engine.test_ops_cuda_paged import CONTEXT, check_cached_prefix, check_paged_batches

pytestmark = pytest.mark.gpu


def _stage(tiny_gguf: Callable[[str], Path], qtype: str, dtype: str) -> Stage:
    source = open_source(tiny_gguf(qtype))
    c = ModelConfig.from_hf(source.config)
    backend = cuda_backend(dtype, cuda_graphs=True)
    return Stage(c, source, 0, c.num_layers, embed=True, head=True, backend=backend)


@pytest.mark.parametrize(("qtype", "dtype"), [("Q8_0", "float32"), ("Q4_K", "float16")])
def test_paged_caches_give_the_contiguous_bits_captured_and_replayed(
    tiny_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, qtype: str, dtype: str
) -> None:
    """Four rounds over the pool (batched and alone in turn): the batch's shape is
    captured in the first and replayed with new block tables in the third."""
    stage = _stage(tiny_gguf, qtype, dtype)
    check_paged_batches(stage, monkeypatch, rounds=4)
    assert stage._runner._graphs  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_cached_prefix_gives_the_bits_of_computing_it(
    tiny_gguf: Callable[[str], Path], dtype: str
) -> None:
    """Resumed by reference, batched, and after a copy-on-write, decode steps replayed
    from one graph over three sequences' tables."""
    check_cached_prefix(_stage(tiny_gguf, "Q8_0", dtype))


def test_the_stage_pool_lives_on_the_device(tiny_gguf: Callable[[str], Path]) -> None:
    stage = _stage(tiny_gguf, "Q8_0", "float16")
    prefix = StagePrefix.for_stage(stage, CONTEXT, budget_bytes=None, salt="run")
    assert prefix.kv is not None
    assert prefix.kv.capacity == pool_blocks(CONTEXT)
    assert isinstance(prefix.kv.k, stage.xp.ndarray)
    cache = prefix.new_cache(CONTEXT)
    assert cache is not None
    assert isinstance(cache.device_blocks, stage.xp.ndarray)
