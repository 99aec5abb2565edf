"""The real-size MoE benchmark's GGUFs (``benchmarks/realsize_moe_gguf.py``): the real
configs' shapes, llama.cpp's Q4_K_M rule for Qwen3-30B-A3B, MXFP4 experts for gpt-oss-20b.
(Writing a file takes minutes at these sizes; the benchmark checks that llama.cpp loads it.)
"""

from __future__ import annotations

from benchmarks.realsize_gguf import use_more_bits
from benchmarks.realsize_moe_gguf import SHAPES, tensor_types

VOCAB = 49152


def _types(shape: str, layers: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (t, dims) for name, t, dims in tensor_types(SHAPES[shape], layers, VOCAB)}


def test_qwen3_30b_a3b_is_the_q4_k_m_mix() -> None:
    types = _types("qwen3-30b-a3b", 48)
    assert types["blk.0.ffn_gate_exps.weight"] == ("Q4_K", (128, 768, 2048))
    assert types["blk.0.attn_q.weight"] == ("Q4_K", (4096, 2048))
    assert types["blk.0.attn_k.weight"][1] == (512, 2048)
    assert types["blk.0.ffn_gate_inp.weight"] == ("F32", (128, 2048))  # never quantized
    assert types["output.weight"][0] == "Q6_K"
    for i in range(48):
        want = "Q6_K" if use_more_bits(i, 48) else "Q4_K"
        assert types[f"blk.{i}.ffn_down_exps.weight"] == (want, (128, 2048, 768))
        assert types[f"blk.{i}.attn_v.weight"][0] == want
    # the first and last 6, and every third of the 36 between
    assert sum(use_more_bits(i, 48) for i in range(48)) == 6 + 6 + 12


def test_gpt_oss_20b_has_mxfp4_experts_biases_and_sinks() -> None:
    types = _types("gpt-oss-20b", 24)
    assert types["blk.3.ffn_up_exps.weight"] == ("MXFP4", (32, 2880, 2880))
    assert types["blk.3.ffn_down_exps.weight"] == ("MXFP4", (32, 2880, 2880))
    assert types["blk.3.attn_q.weight"] == ("Q8_0", (4096, 2880))
    assert types["blk.3.attn_sinks.weight"] == ("F32", (64,))
    assert types["blk.3.ffn_gate_exps.bias"] == ("F32", (32, 2880))
    assert "blk.3.post_attention_norm.weight" in types
    assert len([n for n in types if n.startswith("blk.23.")]) == len(
        [n for n in types if n.startswith("blk.0.")]
    )
