"""ModelConfig from Hugging Face config dicts, RoPE scaling."""

from __future__ import annotations

import math
from typing import Any

import pytest

from meshnode.engine.config import ModelConfig, ModelConfigError

LLAMA31: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_derived_sizes() -> None:
    c = ModelConfig.from_hf(LLAMA31)
    assert (c.head_dim, c.q_size, c.kv_size, c.group_size) == (128, 4096, 1024, 4)
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.rope_type == "llama3"


def test_llama3_rope_keeps_high_and_scales_low_frequencies() -> None:
    scaled = ModelConfig.from_hf(LLAMA31).rope_inv_freq()
    plain = ModelConfig.from_hf(dict(LLAMA31, rope_scaling=None)).rope_inv_freq()
    assert len(scaled) == 64
    for s, p in zip(scaled, plain, strict=True):
        wavelen = 2 * math.pi / p
        if wavelen < 8192 / 4:
            assert s == p
        elif wavelen > 8192 / 1:
            assert s == pytest.approx(p / 8)
        else:
            assert p / 8 < s < p


def test_linear_rope_divides_by_the_factor() -> None:
    linear = {"rope_type": "linear", "factor": 4.0}
    scaled = ModelConfig.from_hf(dict(LLAMA31, rope_scaling=linear)).rope_inv_freq()
    plain = ModelConfig.from_hf(dict(LLAMA31, rope_scaling=None)).rope_inv_freq()
    assert scaled == pytest.approx([p / 4 for p in plain])


def test_transformers5_rope_parameters_block() -> None:
    cfg = dict(
        LLAMA31, rope_scaling=None, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}
    )
    del cfg["rope_theta"]
    c = ModelConfig.from_hf(cfg)
    assert c.rope_theta == 1e4
    assert c.rope_type == "default"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model type"),
        ({"num_key_value_heads": 5}, "multiple of"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unsupported rope"),
        ({"hidden_size": "wide"}, "invalid model config"),
    ],
)
def test_bad_configs(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(dict(LLAMA31, **change))
    missing = dict(LLAMA31)
    del missing["vocab_size"]
    with pytest.raises(ModelConfigError, match="lacks 'vocab_size'"):
        ModelConfig.from_hf(missing)


def test_gguf_rope_freq_factors_match_llama3_scaling() -> None:
    """llama.cpp's rope_freqs divisors reproduce transformers' llama3 frequencies."""
    plain = ModelConfig.from_hf(dict(LLAMA31, rope_scaling=None)).rope_inv_freq()
    scaled = ModelConfig.from_hf(LLAMA31).rope_inv_freq()
    factors = [p / s for p, s in zip(plain, scaled, strict=True)]
    gguf_style = ModelConfig.from_hf(dict(LLAMA31, rope_scaling=None, rope_freq_factors=factors))
    assert gguf_style.rope_inv_freq() == pytest.approx(scaled, rel=1e-12)
    with pytest.raises(ModelConfigError, match="head_dim / 2"):
        ModelConfig.from_hf(dict(LLAMA31, rope_freq_factors=[1.0]))


def test_gemma3_multimodal_config_fills_transformers_defaults() -> None:
    """Gemma 3 4B's config.json: a text_config stating only what differs from the defaults."""
    c = ModelConfig.from_hf(
        {
            "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
        }
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262_208)
    assert [c.window(i) for i in range(6)] == [1024] * 5 + [None]
    assert c.tie_word_embeddings
    assert c.attention_scale == 256**-0.5
    # linear scaling on the global layers only; local layers keep base 10,000 unscaled
    assert c.rope_inv_freq(5)[1] == pytest.approx(1e6 ** (-2 / 256) / 8)
    assert c.rope_inv_freq(0)[1] == pytest.approx(1e4 ** (-2 / 256))


def test_transformers5_gemma3_rope_parameters_per_layer_type() -> None:
    c = ModelConfig.from_hf(
        {
            "model_type": "gemma3_text",
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "vocab_size": 262144,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "sliding_window": 512,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }
    )
    assert (c.rope_theta, c.rope_local_theta, c.rope_type) == (1e6, 1e4, "default")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"hidden_activation": "relu"}, "unsupported activation"),
        ({"layer_types": ["linear_attention"] * 26}, "unsupported layer type"),
    ],
)
def test_gemma3_features_not_implemented_are_refused(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf({"model_type": "gemma3_text", **change})
