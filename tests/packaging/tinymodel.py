"""Tiny random Llama models written as GGUF files, so packaging tests run in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN = 64
FFN = 128
HEADS = 4
KV_HEADS = 2
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one token per byte, as byte-level BPE expects."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _add(w: gguf.GGUFWriter, name: str, x: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        w.add_tensor(name, x.astype(np.float32))
    else:
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)


def write_tiny_gguf(
    path: Path,
    *,
    layers: int = 30,
    tied: bool = True,
    seed: int = 0,
    split_max_tensors: int = 0,
    sampling: dict[str, float | int] | None = None,
) -> Path:
    """A random Llama with ``layers`` blocks: Q4_1 matrices, Q8_0 embedding, F32 norms.

    With ``split_max_tensors``, written as split files ``<stem>-0000k-of-0000N.gguf`` beside
    ``path`` (llama.cpp's gguf-split layout). ``sampling`` maps ``general.sampling.*`` keys
    (``temp``, ``top_k``…) to values (integers as int32, as llama.cpp writes top_k).
    """
    rng = np.random.default_rng(seed)
    tokens = _byte_tokens()
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    w.add_block_count(layers)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(256)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            w.add_int32(f"general.sampling.{key}", value)
        else:
            w.add_float32(f"general.sampling.{key}", value)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.1

    kv = HIDDEN // HEADS * KV_HEADS
    _add(w, "token_embd.weight", mat(len(tokens), HIDDEN), Q.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        _add(w, p + "attn_norm.weight", 1 + mat(1, HIDDEN)[0], Q.F32)
        _add(w, p + "attn_q.weight", mat(HIDDEN, HIDDEN), Q.Q4_1)
        _add(w, p + "attn_k.weight", mat(kv, HIDDEN), Q.Q4_1)
        _add(w, p + "attn_v.weight", mat(kv, HIDDEN), Q.Q4_1)
        _add(w, p + "attn_output.weight", mat(HIDDEN, HIDDEN), Q.Q4_1)
        _add(w, p + "ffn_norm.weight", 1 + mat(1, HIDDEN)[0], Q.F32)
        _add(w, p + "ffn_gate.weight", mat(FFN, HIDDEN), Q.Q4_1)
        _add(w, p + "ffn_up.weight", mat(FFN, HIDDEN), Q.Q4_1)
        _add(w, p + "ffn_down.weight", mat(HIDDEN, FFN), Q.Q4_1)
    _add(w, "output_norm.weight", 1 + mat(1, HIDDEN)[0], Q.F32)
    if not tied:
        _add(w, "output.weight", mat(len(tokens), HIDDEN), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_hf_repo(folder: Path, gguf_path: Path, *, shards: int = 3) -> Path:
    """The model of ``gguf_path`` as a Hugging Face safetensors repo, float32, sharded.

    ``config.json``, ``tokenizer.json`` and ``model-0000k-of-0000N.safetensors`` with
    ``model.safetensors.index.json`` (one shard: ``model.safetensors``, no index).
    """
    from meshnode_packaging.sources import GGUFSource, dequantize
    from safetensors.numpy import save_file

    src = GGUFSource(gguf_path)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**src.config, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(src.tokenizer_json)
    names = src.tensor_names()
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for k, group in enumerate(groups, 1):
        file = "model.safetensors" if shards == 1 else f"model-{k:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name in group:
            hf = name if name == "lm_head.weight" else "model." + name
            tensors[hf] = dequantize(src.tensor(name))
            weight_map[hf] = file
        save_file(tensors, folder / file)
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder
