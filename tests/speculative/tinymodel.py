"""Tiny random Llama models held in memory, for speculation tests that run in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from meshnode_packaging.sources import RawTensor


def tiny_config(vocab: int, layers: int, hidden: int = 32, tied: bool = False) -> dict[str, Any]:
    """A Hugging Face style config of a small GQA Llama (4 query, 2 KV heads)."""
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "intermediate_size": 2 * hidden,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


@dataclass
class TinySource:
    """An in-memory ``ModelSource`` with float32 random weights.

    ``logit_scale`` sets the spread of the (untied) head's logits: wide for greedy tests,
    so that a k-row verify and one-row steps never differ by float32 rounding at a near
    tie; narrow for sampling tests, so that many tokens have real probability.
    """

    config: dict[str, Any]
    seed: int
    logit_scale: float = 1.0
    tokenizer_json: str = "{}"
    chat_template: str | None = None
    tensors: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        c = self.config
        e, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        d = c["head_dim"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

        def w(*shape: int, scale: float | None = None) -> np.ndarray:
            std = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
            return (rng.standard_normal(shape) * std).astype(np.float32)

        t = {"embed_tokens.weight": w(v, e, scale=1.0), "norm.weight": 1 + 0.1 * w(e, scale=1.0)}
        if not c["tie_word_embeddings"]:
            t["lm_head.weight"] = w(v, e, scale=self.logit_scale / np.sqrt(e))
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            t[p + "input_layernorm.weight"] = 1 + 0.1 * w(e, scale=1.0)
            t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * w(e, scale=1.0)
            t[p + "self_attn.q_proj.weight"] = w(q, e)
            t[p + "self_attn.k_proj.weight"] = w(kv, e)
            t[p + "self_attn.v_proj.weight"] = w(kv, e)
            t[p + "self_attn.o_proj.weight"] = w(e, q)
            t[p + "mlp.gate_proj.weight"] = w(f, e)
            t[p + "mlp.up_proj.weight"] = w(f, e)
            t[p + "mlp.down_proj.weight"] = w(e, f)
        self.tensors = t

    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def tensor(self, name: str) -> RawTensor:
        array = self.tensors[name]
        data = np.frombuffer(array.astype("<f4").tobytes(), dtype=np.uint8)
        return RawTensor(name, "F32", tuple(array.shape), data)
