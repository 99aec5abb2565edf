"""The package format: what the writer produces, what open_package reads back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.errors import InvalidPackage, MissingPart
from meshnode_packaging.manifest import MANIFEST_NAME, Manifest, Part, schema
from meshnode_packaging.package import open_package
from meshnode_packaging.sources import RawTensor, dequantize, open_source
from meshnode_packaging.tensorfile import TensorFile, write_tensor_file
from meshnode_packaging.writer import (
    parse_strategy,
    speculative_block,
    to_bf16_bits,
    write_package,
)
from safetensors import safe_open

from tests.packaging.tinymodel import CHAT_TEMPLATE

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_schema_copies_are_identical() -> None:
    published = REPO_ROOT / "packaging" / "schema" / "model-package.schema.json"
    assert json.loads(published.read_text()) == schema()


def test_every_tensor_round_trips_bit_exact(tiny_gguf: Path, tiny_package_ro: Path) -> None:
    src, pkg = open_source(tiny_gguf), open_package(tiny_package_ro)
    assert sorted(pkg.tensor_names()) == sorted(src.tensor_names())
    for name in src.tensor_names():
        a, b = src.tensor(name), pkg.tensor(name)
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
    assert pkg.tensor("layers.3.mlp.up_proj.weight").dtype == "Q4_1"  # quantization survives
    assert isinstance(pkg.tensor("layers.3.mlp.up_proj.weight").data, np.memmap)


def test_manifest_contents(tiny_gguf: Path, tiny_package_ro: Path) -> None:
    m = Manifest.load(tiny_package_ro)
    assert m.data["format"] == {"name": "meshnode-layer-package", "version": 1}
    assert m.data["model"]["source"]["file"] == "tiny.gguf"
    assert m.data["config"] == open_source(tiny_gguf).config
    assert [e["file"] for e in m.layers][:2] == [
        "layers/00000.safetensors",
        "layers/00001.safetensors",
    ]
    assert m.head_tied
    assert m.data["head"]["tensors"] == ["norm.weight"]
    assert m.chat_template == CHAT_TEMPLATE
    # 2 (K and V) x 2 KV heads x head_dim 16 x 4 bytes
    assert m.data["kv_bytes_per_token_per_layer"]["f32"] == 2 * 2 * 16 * 4
    assert m.data["tokenizer"]["bos_token_id"] == 1
    assert m.data["tokenizer"]["eos_token_ids"] == [2]
    sizes = m.layer_weight_bytes()
    assert len(sizes) == 30
    assert len(set(sizes)) == 1
    assert sizes[0] > 0
    for rel, entry in m.files.items():
        assert (tiny_package_ro / rel).stat().st_size == entry["size"]


def test_tensor_bytes_are_the_source_bytes(tiny_gguf: Path, tiny_package_ro: Path) -> None:
    m = Manifest.load(tiny_package_ro)
    weights = sum(e["size"] for rel, e in m.files.items() if rel.endswith(".safetensors"))
    src = open_source(tiny_gguf)
    data = sum(src.tensor(n).data.nbytes for n in src.tensor_names())
    # No byte of tensor data is added; what remains is the safetensors headers (~160 bytes a
    # quantized tensor). A real model's GGUF tokenizer metadata, which moves to tokenizer.json,
    # outweighs them: the real-model test checks package <= source there.
    assert weights - data <= 200 * len(src.tensor_names())


def test_untied_head_holds_lm_head(tiny_gguf_untied: Path, tmp_path: Path) -> None:
    m = write_package(tiny_gguf_untied, tmp_path / "p")
    assert not m.head_tied
    assert m.data["head"]["tensors"] == ["norm.weight", "lm_head.weight"]
    assert m.files_for(Part(29, 30, head=True)) == [
        "layers/00029.safetensors",
        "head.safetensors",
        "tokenizer.json",  # the last stage compiles grammars against it
    ]


def test_files_for_tied_head_fetches_embed(tiny_package_ro: Path) -> None:
    m = Manifest.load(tiny_package_ro)
    assert m.files_for(Part(0, 2, embed=True)) == [
        "embed.safetensors",
        "tokenizer.json",
        "layers/00000.safetensors",
        "layers/00001.safetensors",
    ]
    assert m.files_for(Part(29, 30, head=True)) == [
        "embed.safetensors",
        "layers/00029.safetensors",
        "head.safetensors",
        "tokenizer.json",
    ]
    assert m.files_for(Part(10, 12)) == ["layers/00010.safetensors", "layers/00011.safetensors"]
    with pytest.raises(ValueError, match="exceeds"):
        m.files_for(Part(0, 31))


@pytest.mark.parametrize(
    ("dtype", "stored", "atol"), [("f32", "F32", 0.0), ("f16", "F16", 2e-3), ("bf16", "BF16", 2e-2)]
)
def test_dtype_conversion(
    tiny_gguf: Path, tmp_path: Path, dtype: str, stored: str, atol: float
) -> None:
    write_package(tiny_gguf, tmp_path / dtype, dtype=dtype)  # type: ignore[arg-type]
    pkg, src = open_package(tmp_path / dtype), open_source(tiny_gguf)
    w = pkg.tensor("layers.0.self_attn.q_proj.weight")
    assert w.dtype == stored
    assert pkg.tensor("layers.0.input_layernorm.weight").dtype == "F32"  # 1-D stays F32
    want = dequantize(src.tensor("layers.0.self_attn.q_proj.weight"))
    np.testing.assert_allclose(dequantize(w), want, atol=atol, rtol=0)


def test_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], dtype=np.float32)
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa (1.0);
    # 1 + 3*2^-8 is halfway between 1.0078125 and 1.015625: even is 1.015625.
    want = np.array([1.0, 1.0, 1.015625, -2.5, np.inf], dtype=np.float32)
    got = (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got, want)
    assert np.isnan(
        (to_bf16_bits(np.array([np.nan], np.float32)).astype(np.uint32) << 16).view(np.float32)
    ).all()


def test_tensor_files_open_in_safetensors(tmp_path: Path) -> None:
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = RawTensor("q", "Q8_0", (1, 32), np.arange(34, dtype=np.uint8))
    path = tmp_path / "t.safetensors"
    write_tensor_file(path, [RawTensor("a", "F32", (2, 3), f32.reshape(-1).view(np.uint8)), raw])
    with safe_open(str(path), framework="numpy") as f:
        assert np.array_equal(f.get_tensor("a"), f32)
        assert f.get_tensor("q").shape == (34,)  # raw blocks are U8 to other readers
    tf = TensorFile(path)
    got = tf.raw("q")
    assert (got.dtype, got.shape) == ("Q8_0", (1, 32))
    assert np.array_equal(got.data, raw.data)


def test_partial_package_opens_and_reads_only_what_is_there(tiny_package: Path) -> None:
    for i in range(30):
        if not 10 <= i < 20:
            (tiny_package / f"layers/{i:05d}.safetensors").unlink()
    (tiny_package / "embed.safetensors").unlink()
    (tiny_package / "tokenizer.json").unlink()
    pkg = open_package(tiny_package)
    names = pkg.tensor_names()
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {
        str(i) for i in range(10, 20)
    }
    assert pkg.tensor("layers.15.self_attn.k_proj.weight").shape == (32, 64)
    with pytest.raises(MissingPart, match="layers/00003"):
        pkg.tensor("layers.3.self_attn.k_proj.weight")
    with pytest.raises(MissingPart, match=r"tokenizer\.json"):
        _ = pkg.tokenizer_json
    with pytest.raises(MissingPart, match="no tensor"):
        pkg.tensor("nonsense")


def test_unknown_keys_survive_a_round_trip(tiny_package: Path) -> None:
    path = tiny_package / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["x-publisher"] = {"note": "kept"}
    data["layers"][0]["x-extra"] = [1, 2]
    path.write_text(json.dumps(data))
    m = Manifest.load(tiny_package)
    again = Manifest.loads(m.dumps())
    assert again.data == data
    assert open_package(tiny_package).manifest.data["x-publisher"] == {"note": "kept"}


def test_speculative_block(tiny_gguf: Path, tmp_path: Path) -> None:
    block = speculative_block(
        "ngram",
        [
            "ngram:type=ngram,policy=adaptive,initial_window=4,min_window=2,max_window=12,max_ngram=3",
            "draft:type=draft-model,draft=hf://org/draft",
        ],
    )
    assert block["strategies"]["ngram"] == {
        "type": "ngram",
        "max_ngram": 3,
        "window_policy": {
            "default": "adaptive",
            "initial_window": 4,
            "min_window": 2,
            "max_window": 12,
        },
    }
    m = write_package(tiny_gguf, tmp_path / "p", speculative=block)
    assert Manifest.load(tmp_path / "p").speculative_decoding == block == m.speculative_decoding
    with pytest.raises(ValueError, match="default strategy"):
        speculative_block("missing", ["ngram:type=ngram"])
    with pytest.raises(ValueError, match="needs type"):
        parse_strategy("x:policy=fixed")
    bad = {"default": "d", "strategies": {"d": {"type": "draft-model"}}}  # no draft ref
    with pytest.raises(InvalidPackage, match="draft"):
        write_package(tiny_gguf, tmp_path / "q", speculative=bad)
