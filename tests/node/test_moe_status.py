"""A mixture of experts in ``meshnode status``: experts per layer and active parameters.

:func:`~meshnode.node.footprint.moe_status` against the tiny references' own tensors
(every parameter counted; the idle experts' share left out of the active count) and the
real sizes model cards give; the text ``meshnode status`` prints from it.
"""

from __future__ import annotations

from typing import Any

import pytest
from meshnode_packaging.refs import open_ref

from meshnode.cli.mesh import format_status
from meshnode.engine import ModelConfig
from meshnode.node.footprint import moe_status
from tests.engine.moe_models import MODELS, MOE_DIR
from tests.node.test_status_text import host_body

# Qwen/Qwen3-30B-A3B's config.json (the sizes that matter here): 30.5B, 3.3B active
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 151936,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 40960,
}  # fmt: skip


@pytest.mark.parametrize("model", MODELS)
def test_tiny_references_counts_are_their_tensors(model: str) -> None:
    source = open_ref(str(MOE_DIR / model))
    config = ModelConfig.from_hf(source.config)
    got = moe_status(config)
    assert got is not None
    n = source.config.get("num_experts") or source.config["num_local_experts"]
    assert got["experts_per_layer"] == n
    assert got["experts_per_token"] == source.config["num_experts_per_tok"]
    assert got["layers"] == config.num_layers
    sizes = {name: source.tensor(name).data.nbytes // 4 for name in source.tensor_names()}
    total = sum(sizes.values())
    experts = sum(s for name, s in sizes.items() if ".mlp.experts." in name)
    idle = experts * (n - got["experts_per_token"]) // n
    assert got["params"] == pytest.approx(total, rel=0.01)
    assert got["active_params"] == pytest.approx(total - idle, rel=0.01)


def test_qwen3_30b_a3b_counts_match_its_model_card() -> None:
    got = moe_status(ModelConfig.from_hf(QWEN3_30B_A3B))
    assert got is not None
    assert (got["experts_per_layer"], got["experts_per_token"], got["moe_layers"]) == (128, 8, 48)
    assert got["params"] == pytest.approx(30.5e9, rel=0.01)
    assert got["active_params"] == pytest.approx(3.3e9, rel=0.02)


def test_a_dense_model_has_no_moe_part() -> None:
    dense = {**QWEN3_30B_A3B, "model_type": "qwen3", "num_experts": 0}
    assert moe_status(ModelConfig.from_hf(dense)) is None


def test_status_text_shows_experts_and_active_parameters() -> None:
    body: dict[str, Any] = host_body("ready")
    moe = moe_status(ModelConfig.from_hf(QWEN3_30B_A3B))
    body["host"]["moe"] = moe
    text = format_status(body)
    assert "experts  128 per layer, 8 per token, on 48 of 48 layers; 30.5B parameters, " in text
    assert "3.4B active" in text  # 3.35e9 (the card rounds it down to 3.3B)
    assert "experts " not in format_status(host_body("ready"))
