"""A prompt resumed from a cached prefix gets the bits of the same prompt prefilled whole
(issue 30): one dense stage, its prefix blocks stored by the uncached prefill itself and
taken in place (:class:`~meshnode.engine.prefix_cache.PrefixPool`), the suffix computed
from the block boundary. The logits of the last row and the suffix's keys and values are
equal bit for bit, for float32 and float16 K/V, whether the uncached prompt went in one
forward or in chunks cut elsewhere, as long as every piece has more rows than the
few-row paths take (``KERNEL_MAX_ROWS``: a short piece's products and attention round
otherwise), as the host's prefill pieces have.

The model is a tiny random float32 Llama with heads of 16, run by the real
:class:`~meshnode.engine.model.Stage`: float32 weights take the compiled attention kernel
for every piece, as a stage over GGUF blocks does (``tests/engine/test_cut_bits.py``), and
their products a path fixed by the piece's rows (``cpu.dense_product``). It holds on any
BLAS: the NumPy reference's attention, which float32 stages took before, rounds a row by
the rows beside it where OpenBLAS picks its Haswell kernels (AVX2 CPUs).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from meshnode.engine.attention import KERNEL_MAX_ROWS
from meshnode.engine.config import ModelConfig
from meshnode.engine.kv_pages import BlockPool, PagedCache
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.prefix_cache import PrefixPool
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 256
PROMPT = [(11 * i + 5) % 45 + 3 for i in range(150)]


@pytest.fixture(scope="module")
def stage() -> Stage:
    source = TinySource(tiny_config(48, 3, hidden=64), seed=3, logit_scale=8.0)
    config = ModelConfig.from_hf(source.config)
    return Stage(config, source, 0, config.num_layers, embed=True, head=True)


def _prefill(stage: Stage, cache: Any, start: int, cuts: list[int]) -> np.ndarray:
    """``PROMPT[start:]`` (``cache``: a paged cache, which ``Stage.forward`` takes as it
    takes a ``KVCache``) in pieces ending at ``cuts`` (and at the prompt's end); the last
    row's logits."""
    bounds = [start, *(c for c in cuts if c > start), len(PROMPT)]
    logits = None
    for a, b in itertools.pairwise(bounds):
        assert b - a > KERNEL_MAX_ROWS, "every piece takes the many-row paths"
        logits = stage.forward(np.array(PROMPT[a:b]), a, cache, out_rows=1)
    assert logits is not None
    return np.asarray(logits)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize(
    ("cached", "cuts"),
    [(2 * B, []), (B, [100]), (3 * B, [40]), (4 * B, [64, 120])],
    ids=["whole", "cut-after", "cut-before", "two-cuts"],
)
def test_a_resumed_prefill_is_the_same_bits_as_an_uncached_one(
    stage: Stage, dtype: type, cached: int, cuts: list[int]
) -> None:
    c = stage.config
    kv = BlockPool(c.num_layers, c.num_kv_heads, c.head_dim, 4 * CONTEXT // B, dtype)
    prefixes = PrefixPool(kv, "test", CONTEXT // B)
    whole = PagedCache(kv, CONTEXT)
    want = _prefill(stage, whole, 0, cuts)
    keys = prefixes.store(PROMPT[:cached], whole, 0)
    resumed = PagedCache(kv, CONTEXT)
    tokens, _ = prefixes.acquire(keys[-1], resumed)
    assert tokens == PROMPT[:cached]
    assert set(resumed.slots()) <= set(whole.slots()), "the prefix is read in place"
    got = _prefill(stage, resumed, cached, cuts)
    np.testing.assert_array_equal(got, want)
    for layer in range(c.num_layers):
        for mine, theirs in zip(
            resumed.gather(layer, len(PROMPT)), whole.gather(layer, len(PROMPT)), strict=True
        ):
            np.testing.assert_array_equal(mine[:, cached:], theirs[:, cached:])
