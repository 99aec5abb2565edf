"""Model sources: dequantization, Q/K un-permutation, GGUF == HF folder, tokenizer, errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from meshnode_packaging.sources import (
    RawTensor,
    SourceError,
    default_model_path,
    dequantize,
    open_source,
    unpermute_rows,
)
from tokenizers import Tokenizer

from meshnode.engine.backend import cpu_backend
from meshnode.engine.loader import LoadedModel, load_model
from tests.engine.tiny import (
    CONFIG,
    hf_tokenizer_json,
    llama_permute,
    random_blocks,
    vocabulary,
    write_tiny_model,
)

QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_reference(qtype: str) -> None:
    blocks = random_blocks(np.random.default_rng(1), (8, 512), qtype)
    raw = RawTensor("w", qtype, (8, 512), np.ascontiguousarray(blocks).view(np.uint8).ravel())
    if qtype in ("F32", "F16"):
        expected = blocks.astype(np.float32)
    else:
        expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    got = dequantize(raw)
    assert got.dtype == np.float32
    assert got.shape == (8, 512)
    np.testing.assert_array_equal(got, expected)


def test_dequantize_bf16_is_the_top_half_of_float32() -> None:
    values = np.array([[1.5, -2.25], [3.0e38, 1e-3]], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    got = dequantize(RawTensor("w", "BF16", (2, 2), bf16.view(np.uint8)))
    np.testing.assert_array_equal(got, (bf16.astype(np.uint32) << 16).view(np.float32))
    assert got[0, 0] == 1.5


def test_dequantize_rejects_unknown_dtype() -> None:
    with pytest.raises(SourceError, match="unknown dtype"):
        dequantize(RawTensor("w", "Q9_9", (1, 32), np.zeros(32, np.uint8)))


@pytest.mark.parametrize(("rows", "heads"), [(8, 2), (12, 3), (64, 4)])
def test_unpermute_inverts_llama_cpp_permute(rows: int, heads: int) -> None:
    w = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
    np.testing.assert_array_equal(unpermute_rows(llama_permute(w, heads), heads), w)
    bias = np.arange(rows, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rows(llama_permute(bias, heads), heads), bias)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_and_hf_folder_give_identical_logits(
    tiny_gguf: Callable[[str], Path], qtype: str
) -> None:
    path = tiny_gguf(qtype)
    a = load_model(str(path), cpu_backend())
    b = load_model(str(path.parent / "hf"), cpu_backend())
    ids = a.tokenizer.encode("<|im_start|>the 12 then")
    assert ids == b.tokenizer.encode("<|im_start|>the 12 then")
    la = a.stage.forward(np.array(ids), 0, a.stage.new_cache(32))
    lb = b.stage.forward(np.array(ids), 0, b.stage.new_cache(32))
    assert la.shape == (len(ids), len(vocabulary()))
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)


def test_qwen2_gguf_with_qkv_bias_matches_hf_folder(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "Q8_0", arch="qwen2")
    a = load_model(str(path), cpu_backend())
    b = load_model(str(path.parent / "hf"), cpu_backend())
    assert a.config.attention_bias
    assert a.config.model_type == "qwen2"
    ids = [1, 60, 70, 80, 90]
    la = a.stage.forward(np.array(ids), 0, a.stage.new_cache(8))
    lb = b.stage.forward(np.array(ids), 0, b.stage.new_cache(8))
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)


def test_gguf_config_maps_to_hf_keys(tiny_gguf: Callable[[str], Path]) -> None:
    config = open_source(tiny_gguf("Q8_0")).config
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "num_key_value_heads",
        "intermediate_size",
        "rope_theta",
        "eos_token_id",
    ):
        assert config[key] == CONFIG[key], key
    assert config["vocab_size"] == len(vocabulary())
    assert config["tie_word_embeddings"] is True


def test_gguf_tokenizer_splits_digits_like_the_original(tiny_gguf: Callable[[str], Path]) -> None:
    built = Tokenizer.from_str(open_source(tiny_gguf("Q8_0")).tokenizer_json or "")
    reference = Tokenizer.from_str(hf_tokenizer_json())
    vocab = vocabulary()
    for text in ["x 12 the", "<|im_end|>\n\n12", "héllo 1234"]:
        ids = built.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids
        assert "12" not in [vocab[i] for i in ids]  # digits never merge
    assert built.encode("<|im_end|>", add_special_tokens=False).ids == [2]


@pytest.mark.real_model
def test_smollm2_tokenizer_splits_digits_after_whitespace(smollm2: LoadedModel) -> None:
    # The golden README's example: the original tokenizer gives [1116, 33], not 198 198 33.
    assert smollm2.tokenizer.encode("\n\n1") == [1116, 33]
    assert smollm2.tokenizer.encode("<|im_end|>") == [2]
    assert smollm2.tokenizer.encode("<|im_end|>", parse_special=False) != [2]


def test_unsupported_architecture_is_a_source_error(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match="unsupported GGUF architecture 'falcon'"):
        open_source(path)


def test_missing_and_non_gguf_paths(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        open_source(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model")
    with pytest.raises(SourceError, match="not a GGUF"):
        open_source(junk)
    with pytest.raises(SourceError, match=r"config\.json not found"):
        open_source(tmp_path)


def test_default_model_alias() -> None:
    path = default_model_path("smollm2-135m")
    assert path.suffix == ".gguf"
    assert path.is_file()
    with pytest.raises(SourceError, match="unknown model alias"):
        default_model_path("gpt-17")
