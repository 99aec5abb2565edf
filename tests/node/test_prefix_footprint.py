"""The KV a stage holds at most, counted by a pure function the planner calls
(``footprint.stage_kv_bytes``, ``ModelFootprint.kv_bytes``): a CPU or CUDA stage's one pool
of blocks, a few whole contexts (``prefix.pool_blocks``; issue 30), exactly; a hybrid
stage every live sequence's context."""

from __future__ import annotations

import pytest

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.weights import HeldBytes
from meshnode.errors import PlanError
from meshnode.node.footprint import model_footprint, stage_kv_bytes
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.planner import ModelFootprint, NodeCapacity, plan
from meshnode.node.prefix import DEFAULT_POOL_CONTEXTS, pool_blocks
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
    per_block = per_cache // (CONTEXT // B)
    got = stage_kv_bytes(config, start, end, CONTEXT)
    assert got == held
    # a few whole contexts (fewer than the sequence limit) and a block for a copy-on-write
    assert DEFAULT_POOL_CONTEXTS < MAX_SEQUENCES_PER_STAGE
    assert got == DEFAULT_POOL_CONTEXTS * per_cache + per_block
    # what the sequences may hold together, as the status and /metrics show it
    assert runner.kv_usage()["capacity_tokens"] == DEFAULT_POOL_CONTEXTS * CONTEXT
    # cached prefixes may use every block that no sequence holds
    assert runner.prefix.pool.budget == runner.prefix.kv.capacity == pool_blocks(CONTEXT)
    assert model_footprint(config).kv_bytes(start, end, CONTEXT, "cuda") == got  # the same pool
    live = MAX_SEQUENCES_PER_STAGE * per_cache  # a device not known: every context
    assert model_footprint(config).kv_bytes(start, end, CONTEXT, "tpu") == live


def test_a_smaller_sequence_limit_keeps_a_smaller_pool() -> None:
    assert pool_blocks(CONTEXT, 1) == CONTEXT // B + 1
    assert pool_blocks(CONTEXT, 2) == 2 * CONTEXT // B + 1
    assert pool_blocks(CONTEXT + 1, 2) == 2 * (CONTEXT // B + 1) + 1  # whole blocks
    with pytest.raises(ValueError, match="bad KV pool"):
        pool_blocks(0)


def test_f16_halves_it_and_a_hybrid_model_keeps_no_pool() -> None:
    config = ModelConfig.from_hf(TinySource(tiny_config(48, 3), seed=0).config)
    assert 2 * stage_kv_bytes(config, 0, 3, CONTEXT, "f16") == stage_kv_bytes(config, 0, 3, CONTEXT)
    hybrid = ModelConfig.from_hf(HybridFolder().config)
    layers = hybrid.num_layers
    live = model_footprint(hybrid).kv_bytes(0, layers, CONTEXT, "cuda")
    assert stage_kv_bytes(hybrid, 0, layers, CONTEXT) == live
    assert model_footprint(hybrid).kv_bytes(0, layers, CONTEXT, "cpu") == live


def _eight_b(kv_dtype: str) -> ModelFootprint:
    """An 8B-shaped Llama (32 layers, 8 KV heads of 128) whose weights take 4.4 GiB."""
    shape = tiny_config(128256, 32, hidden=4096) | {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
    }
    config = ModelConfig.from_hf(shape)
    weights = int(4.4 * 2**30)
    held = HeldBytes((weights // 32,) * 32, weights - 32 * (weights // 32), 0)
    return model_footprint(config, held=held, kv_dtype=kv_dtype)


@pytest.mark.parametrize(
    ("device", "kv_dtype", "needs_mib"),
    [
        ("tpu", "f32", 6554),  # issue 30's figure: 8 contexts of 256 MiB each
        ("cpu", "f32", 5538),  # 4 contexts and a block: 1032 MiB of KV
        ("cpu", "f16", 5022),
        ("cuda", "f32", 5538),  # the same pool on a CUDA node
        ("cuda", "f16", 5022),
    ],
)
def test_the_planner_reserves_the_pool_on_cpu_and_cuda_nodes(
    device: str, kv_dtype: str, needs_mib: int
) -> None:
    """The table of issue 30's example, at a 1,024-token context: what one node must
    offer for the whole model, by the node's device and the KV dtype."""
    footprint = _eight_b(kv_dtype)
    short = [NodeCapacity("host", 2**20, device)]
    with pytest.raises(PlanError, match=f"the model needs {needs_mib} MiB for a 1024-token"):
        plan(footprint, short, "host", 1024)
    enough = [NodeCapacity("host", needs_mib * 2**20, device)]
    assert plan(footprint, enough, "host", 1024).node_ids == ("host",)
    less = [NodeCapacity("host", (needs_mib - 1) * 2**20, device)]
    with pytest.raises(PlanError):
        plan(footprint, less, "host", 1024)


def test_a_mixed_mesh_counts_each_stage_by_its_device() -> None:
    """A CPU node and a CUDA node of the same memory keep the same pool: the layers split
    evenly (each takes 16 of 32); beside a device the planner does not know, which
    preallocates 8 contexts, the CPU node takes more."""
    footprint = _eight_b("f32")
    nodes = [NodeCapacity("host", 3 * 2**30, "cpu"), NodeCapacity("gpu", 3 * 2**30, "cuda")]
    stages = plan(footprint, nodes, "host", 1024).stages
    assert [s.node_id for s in stages] == ["host", "gpu"]
    assert [s.end - s.start for s in stages] == [16, 16]
    nodes[1] = NodeCapacity("gpu", 3 * 2**30, "tpu")
    stages = plan(footprint, nodes, "host", 1024).stages
    assert stages[0].end - stages[0].start > stages[1].end - stages[1].start
