"""Tiny random Llama models written as a GGUF file and as a Hugging Face folder.

Both files hold the same weights: the HF folder gets, in float32, exactly what the GGUF's
quant blocks decode to (computed with gguf's reference dequantizer on HF-layout rows), and
the GGUF gets those blocks with Q/K rows permuted the way llama.cpp's converter does. So a
correct reader gives identical logits for both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,  # K-quants need rows of 256
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("1", "2")]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary() -> list[str]:
    """Specials, the 256 byte-level symbols, then one token per merge."""
    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    byte_symbols.sort(key=lambda s: ord(s))
    return SPECIALS + byte_symbols + [a + b for a, b in MERGES]


def hf_tokenizer_json() -> str:
    """The tokenizer built directly with ``tokenizers`` (independent of the GGUF path)."""
    vocab = {t: i for i, t in enumerate(vocabulary())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return str(tok.to_str())


def _weight_names(layers: int) -> list[tuple[str, str, tuple[int, int]]]:
    """(hf name, gguf name, [out, in]) of every matrix."""
    c = CONFIG
    e, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", "token_embd.weight", (len(vocabulary()), e))]
    for n in range(layers):
        hp, gp = f"model.layers.{n}.", f"blk.{n}."
        out += [
            (hp + "self_attn.q_proj.weight", gp + "attn_q.weight", (q, e)),
            (hp + "self_attn.k_proj.weight", gp + "attn_k.weight", (kv, e)),
            (hp + "self_attn.v_proj.weight", gp + "attn_v.weight", (kv, e)),
            (hp + "self_attn.o_proj.weight", gp + "attn_output.weight", (e, q)),
            (hp + "mlp.gate_proj.weight", gp + "ffn_gate.weight", (i, e)),
            (hp + "mlp.up_proj.weight", gp + "ffn_up.weight", (i, e)),
            (hp + "mlp.down_proj.weight", gp + "ffn_down.weight", (e, i)),
        ]
    return out


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: str) -> np.ndarray:
    """Quant blocks ``[rows, bytes]`` of type ``qtype`` holding small random values."""
    t = gguf.GGMLQuantizationType[qtype]
    w = (rng.standard_normal(shape) * 0.08).astype(np.float32)
    if qtype in ("F32", "F16"):
        return w.astype(np.float16 if qtype == "F16" else np.float32)
    if qtype not in ("Q4_K", "Q6_K"):
        return np.asarray(gguf.quants.quantize(w, t))
    # gguf-py cannot quantize K-quants: write random blocks with sane float16 scales.
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = np.full((shape[0], shape[1] // block, 2), 0.002, dtype=np.float16).view(np.uint8)
    if qtype == "Q4_K":  # block: d, dmin (f16), scales[12], qs[128]
        raw[..., 0:4] = scales
    else:  # Q6_K block: ql[128], qh[64], scales[16] (int8), d (f16)
        raw[..., 208:210] = scales[..., 0:2]
    return raw.reshape(shape[0], -1)


def llama_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py) on whole rows."""
    r = rows.shape[0]
    return (
        rows.reshape(n_head, 2, r // n_head // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _decode(data: np.ndarray, qtype: str) -> np.ndarray:
    if qtype in ("F32", "F16"):
        return data.astype(np.float32)
    return np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]))


# Tiny Gemma 3: layers 0 and 2 slide over 4 positions, layer 1 is global; the two kinds
# have different RoPE bases, as in the real model (10,000 local, 1,000,000 global).
GEMMA3_WINDOW = 4
GEMMA3_PATTERN = 2
GEMMA3_CONFIG: dict[str, Any] = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window": GEMMA3_WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 64,
}


def arch_config(arch: str) -> dict[str, Any]:
    """The HF config of the tiny model of GGUF architecture ``arch``."""
    c = dict(CONFIG, model_type=arch, attention_bias=arch == "qwen2")
    if arch == "gemma3":
        c.update(GEMMA3_CONFIG)
        del c["hidden_act"]
    return c


def write_tiny_model(folder: Path, qtype: str, *, seed: int = 0, arch: str = "llama") -> Path:
    """Write ``folder/tiny.gguf`` and the HF folder ``folder/hf``; return the GGUF path.

    ``arch`` "qwen2" adds Q/K/V biases and, as llama.cpp does for Qwen2, stores Q/K rows
    unpermuted; "qwen3" adds QK-norm; "gemma3" adds QK-norm and the norms after attention
    and MLP, stored in the GGUF plus one as llama.cpp's converter does.
    """
    rng = np.random.default_rng(seed)
    c = arch_config(arch)
    layers = c["num_hidden_layers"]
    hf: dict[str, np.ndarray] = {}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.gguf"
    w = gguf.GGUFWriter(path, arch)
    _gguf_metadata(w, arch)
    for hf_name, g_name, shape in _weight_names(layers):
        data = random_blocks(rng, shape, "Q8_0" if "embed" in hf_name else qtype)
        dtype = "Q8_0" if "embed" in hf_name else qtype
        hf[hf_name] = _decode(data, dtype).reshape(shape)
        heads = {"attn_q": c["num_attention_heads"], "attn_k": c["num_key_value_heads"]}
        n_head = next((h for k, h in heads.items() if k in g_name), None)
        n_head = n_head if arch == "llama" else None
        stored = data if n_head is None else llama_permute(data, n_head)
        raw_dtype = None if dtype in ("F32", "F16") else gguf.GGMLQuantizationType[dtype]
        w.add_tensor(g_name, np.ascontiguousarray(stored), raw_dtype=raw_dtype)
    norms = [("model.norm.weight", "output_norm.weight", c["hidden_size"])]
    for n in range(layers):
        norms += _layer_norms(n, arch, c["hidden_size"], c["head_dim"])
    if c["attention_bias"]:
        for n in range(layers):
            for x, size in (
                ("q", c["num_attention_heads"]),
                ("k", c["num_key_value_heads"]),
                ("v", c["num_key_value_heads"]),
            ):
                bias = (0.1 * rng.standard_normal(size * c["head_dim"])).astype(np.float32)
                hf[f"model.layers.{n}.self_attn.{x}_proj.bias"] = bias
                w.add_tensor(f"blk.{n}.attn_{x}.bias", bias)
    shift = np.float32(1.0 if arch == "gemma3" else 0.0)
    for hf_name, g_name, size in norms:
        norm = (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        if shift:  # Gemma checkpoints hold weight - 1; pick values exact both ways
            norm = (norm + shift) - shift
        hf[hf_name] = norm
        w.add_tensor(g_name, norm + shift)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _write_hf_folder(folder / "hf", hf, c)
    return path


def _layer_norms(n: int, arch: str, hidden: int, head_dim: int) -> list[tuple[str, str, int]]:
    """(hf name, gguf name, size) of layer ``n``'s norm weights."""
    hp, gp = f"model.layers.{n}.", f"blk.{n}."
    ffn = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    out = [
        (hp + "input_layernorm.weight", gp + "attn_norm.weight", hidden),
        (hp + ffn + ".weight", gp + "ffn_norm.weight", hidden),
    ]
    if arch in ("qwen3", "gemma3"):
        out += [
            (hp + "self_attn.q_norm.weight", gp + "attn_q_norm.weight", head_dim),
            (hp + "self_attn.k_norm.weight", gp + "attn_k_norm.weight", head_dim),
        ]
    if arch == "gemma3":
        out += [
            (hp + "post_attention_layernorm.weight", gp + "post_attention_norm.weight", hidden),
            (hp + "post_feedforward_layernorm.weight", gp + "post_ffw_norm.weight", hidden),
        ]
    return out


def _gguf_metadata(w: gguf.GGUFWriter, arch: str) -> None:
    c = arch_config(arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if arch == "gemma3":
        w.add_sliding_window(GEMMA3_WINDOW)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", GEMMA3_PATTERN)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    vocab = vocabulary()
    w.add_token_list(vocab)
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)


def _write_hf_folder(folder: Path, tensors: dict[str, np.ndarray], c: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(c, vocab_size=len(vocabulary()))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(hf_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    save_file(tensors, str(folder / "model.safetensors"))


def greedy(stage: Any, prompt: Any = (1, 5, 9, 14, 3), steps: int = 4) -> list[int]:
    """``stage``'s (a whole model's) greedy tokens after ``prompt``: the first of its
    prefill, then ``steps`` decode steps."""
    cache = stage.new_cache(32)
    logits = stage.forward(np.asarray(prompt), 0, cache, out_rows=1)
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(steps):
        logits = stage.forward(np.asarray(tokens[-1:]), cache.length, cache, out_rows=1)
        tokens.append(int(np.argmax(logits[-1])))
    return tokens
