"""Layer-package metadata of a hybrid model: DeltaNet layers hold no KV but a fixed state,
sized as the engine allocates it."""

from __future__ import annotations

from meshnode_packaging.writer import recurrent_layer

from meshnode.engine.hybrid_config import HybridConfig
from tests.engine.hybrid_model import HybridFolder


def test_deltanet_layers_declare_their_recurrent_state() -> None:
    config = HybridFolder().config
    hybrid = HybridConfig.from_hf(config)
    for i, kind in enumerate(config["layer_types"]):
        entry = recurrent_layer(config, i)
        if kind == "linear_attention":
            assert entry == {
                "kv_cache": False,
                "recurrent_state_bytes": hybrid.recurrent_shape().nbytes(),
            }
        else:
            assert entry == {}


def test_plain_models_get_no_extra_keys() -> None:
    assert recurrent_layer({"model_type": "llama", "num_hidden_layers": 2}, 0) == {}
