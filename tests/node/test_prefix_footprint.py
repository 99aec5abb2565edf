"""The KV a stage holds at most, counted by a pure function the planner can call
(``footprint.stage_kv_bytes``): the stage's one pool of blocks, for the live sequences'
contexts plus the cached prefixes' budget (``prefix.pool_bytes``; issue 30), exactly."""

from __future__ import annotations

import pytest

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.node.footprint import model_footprint, stage_kv_bytes
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.prefix import DEFAULT_PREFIX_CONTEXTS, pool_bytes
from meshnode.node.stage import StageRunner
from tests.engine.hybrid_model import HybridFolder
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 256


@pytest.mark.parametrize(("start", "end"), [(0, 3), (1, 3)])
def test_the_count_covers_what_a_stage_allocates(start: int, end: int) -> None:
    source = TinySource(tiny_config(48, 3), seed=0)
    config = ModelConfig.from_hf(source.config)
    stage = Stage(config, source, start, end, embed=start == 0, head=end == 3)
    runner = StageRunner(stage, context_size=CONTEXT)
    assert runner.prefix.pool is not None
    assert runner.prefix.kv is not None
    held = runner.prefix.kv.nbytes()  # the stage's one pool: live and cached blocks
    per_cache = stage.new_cache(CONTEXT).nbytes()
    want_pool = pool_bytes(config, end - start, CONTEXT, "f32")
    assert want_pool == DEFAULT_PREFIX_CONTEXTS * per_cache
    per_block = per_cache // (CONTEXT // B)
    assert runner.prefix.pool.budget == want_pool // per_block
    got = stage_kv_bytes(config, start, end, CONTEXT)
    assert got == held
    # every live sequence's context, a block for a copy-on-write, the cached budget
    assert got == MAX_SEQUENCES_PER_STAGE * per_cache + per_block + want_pool
    live = model_footprint(config).kv_bytes(start, end, CONTEXT)
    assert stage_kv_bytes(config, start, end, CONTEXT, prefix_pool=False) == live


def test_f16_halves_it_and_a_hybrid_model_keeps_no_pool() -> None:
    config = ModelConfig.from_hf(TinySource(tiny_config(48, 3), seed=0).config)
    assert 2 * stage_kv_bytes(config, 0, 3, CONTEXT, "f16") == stage_kv_bytes(config, 0, 3, CONTEXT)
    hybrid = ModelConfig.from_hf(HybridFolder().config)
    assert pool_bytes(hybrid, 2, CONTEXT, "f32") == 0
    layers = hybrid.num_layers
    live = model_footprint(hybrid).kv_bytes(0, layers, CONTEXT)
    assert stage_kv_bytes(hybrid, 0, layers, CONTEXT) == live
