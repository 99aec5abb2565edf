"""The planner's memory model for hybrid models: KV only on the attention layers, a fixed
recurrent state (with its snapshot ring) per sequence on the Gated DeltaNet layers."""

from __future__ import annotations

from meshnode.engine.config import ModelConfig
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.node.footprint import model_footprint
from meshnode.node.hybrid_prefix import SNAPSHOT_CONTEXTS
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.planner import ModelFootprint, NodeCapacity, plan
from tests.engine.hybrid_model import HybridFolder

MIB = 1 << 20


def _footprint() -> ModelFootprint:
    return model_footprint(ModelConfig.from_hf(HybridFolder().config))


def test_deltanet_layers_hold_a_fixed_state_and_no_kv() -> None:
    fp = _footprint()
    config = ModelConfig.from_hf(HybridFolder().config)
    assert config.hybrid is not None
    assert fp.kv_layers == tuple(t == "full_attention" for t in config.hybrid.layer_types)
    state = config.hybrid.recurrent_shape().nbytes()
    # every live sequence's state and ring, and the cached prefixes' snapshots
    want = state * (1 + DEFAULT_RING_SLOTS) * MAX_SEQUENCES_PER_STAGE + state * SNAPSHOT_CONTEXTS
    for linear, fixed in zip(fp.kv_layers, fp.fixed_layer_bytes, strict=True):
        assert fixed == (0 if linear else want)
    per_token = 2 * config.num_kv_heads * config.head_dim * 4
    assert fp.kv_bytes_per_token_per_layer == per_token * (
        MAX_SEQUENCES_PER_STAGE + SNAPSHOT_CONTEXTS
    )


def test_layer_bytes_are_the_checkpoint_parameters() -> None:
    folder = HybridFolder()
    fp = _footprint()
    for i, layer_bytes in enumerate(fp.layer_bytes):
        names = [n for n in folder.tensor_names() if n.startswith(f"layers.{i}.")]
        params = sum(int(folder.tensor(n).data.nbytes) // 4 for n in names)
        assert layer_bytes == 4 * params


def test_context_grows_only_the_attention_layers() -> None:
    fp = _footprint()
    nodes = [NodeCapacity("host", 64 * MIB)]
    short, long = (plan(fp, nodes, "host", n).stages[0].memory_bytes for n in (128, 1024))
    kv_layers = sum(fp.kv_layers)
    assert long - short == kv_layers * fp.kv_bytes_per_token_per_layer * (1024 - 128)
