"""GPU benchmark: decode speed, one stream and batched, and the weight bandwidth it achieves.

Run on a machine with an NVIDIA GPU (CuPy installed, ``scripts/install.sh`` picks it):
``.venv/bin/python benchmarks/gpu.py`` (add ``--tokens N``, ``--models 1b``, ...).
Smoke test anywhere, in seconds: ``.venv/bin/python benchmarks/gpu.py --device cpu --tiny``.

For each model (the default SmolLM2-135M, and a Llama-3.2-1B-shaped model with random
weights built here), weight format (float16; Q8_0 kept quantized on the device), CUDA
graphs on/off and number of streams (``--streams``, default 1 and 8), one row:

- tok/s: greedy decode after a short prompt, logits to the host each token, summed over
  the streams; with several, every step is one batched forward of all of them
  (``Stage.forward_batch``, issue 16), so the ratio of the 8-stream row to the 1-stream
  row is what batching buys;
- wall ms: one step (a token of every stream); device ms: one captured step replayed
  back to back (CUDA events): the GPU's share of it; host ms = wall ms - device ms:
  Python, launches and copies;
- weights/token: bytes of weights one decode step reads (every layer and the head);
- GB/s and % copy: weights/token x steps/s, against a device-to-device copy's bandwidth
  (bytes read + written) measured in the same run. The goal on the 8B shape (one stream)
  is >= 60 %.

Then a second table: prefill, one prompt of ``--prefill`` tokens (512) per model and
weight format, its wall time to the last row's logits on the host (a long prompt runs
alone, each layer's weights expanded for cuBLAS).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from meshnode_packaging.sources import ModelSource, RawTensor, dequantize

from meshnode.engine.backend import Backend, BackendError, select_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.kv_cache import KV_BLOCK
from meshnode.engine.kv_pages import BlockPool, PagedCache
from meshnode.engine.loader import resolve_source
from meshnode.engine.model import BatchRow, Stage

LLAMA_1B: dict[str, Any] = {  # Llama-3.2-1B's config.json sizes
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
# Llama-3.1-8B's config.json sizes (the head reads the embedding's bytes: same size as its
# own lm_head, which a random source need not hold twice)
LLAMA_8B: dict[str, Any] = dict(
    LLAMA_1B,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rope_scaling=dict(LLAMA_1B["rope_scaling"], factor=8.0),
)
TINY: dict[str, Any] = dict(
    LLAMA_1B,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=512,
    rope_scaling=None,
)


class RandomSource:
    """A :class:`ModelSource` of random weights in one format (``F16`` or ``Q8_0``).

    Every layer gets the same bytes (generated once per shape): a decode step still reads
    each layer's own device copy, which is what the benchmark measures.
    """

    def __init__(self, config: dict[str, Any], dtype: str, seed: int = 0) -> None:
        self.config = config
        self.tokenizer_json = ""
        self.chat_template: str | None = None
        self._dtype = dtype
        self._rng = np.random.default_rng(seed)
        self._made: dict[tuple[int, int], np.ndarray] = {}
        c = config
        d = c["head_dim"]
        e, i = c["hidden_size"], c["intermediate_size"]
        self._shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (c["vocab_size"], e),
            "norm.weight": (e,),
        }
        for n in range(c["num_hidden_layers"]):
            p = f"layers.{n}."
            self._shapes |= {
                p + "input_layernorm.weight": (e,),
                p + "post_attention_layernorm.weight": (e,),
                p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, e),
                p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, e),
                p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, e),
                p + "self_attn.o_proj.weight": (e, c["num_attention_heads"] * d),
                p + "mlp.gate_proj.weight": (i, e),
                p + "mlp.up_proj.weight": (i, e),
                p + "mlp.down_proj.weight": (e, i),
            }

    def tensor_names(self) -> list[str]:
        return list(self._shapes)

    def tensor(self, name: str) -> RawTensor:
        shape = self._shapes[name]
        if len(shape) == 1:
            return RawTensor(name, "F32", shape, np.ones(shape, np.float32).view(np.uint8))
        rows, cols = shape
        data = self._made.get((rows, cols))
        if data is None:
            data = self._made[(rows, cols)] = self._random(rows, cols)
        return RawTensor(name, self._dtype, shape, data)

    def _random(self, rows: int, cols: int) -> np.ndarray:
        if self._dtype == "F16":
            w = self._rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        blocks = np.empty((rows, cols // 32, 34), np.uint8)  # Q8_0: d (f16), 32 x int8
        blocks[..., :2] = np.full((rows, cols // 32, 1), 0.02 / 64, np.float16).view(np.uint8)
        blocks[..., 2:] = self._rng.integers(-127, 128, (rows, cols // 32, 32), dtype=np.int8)
        return blocks.reshape(-1)


class Requantized:
    """``source`` with every matrix re-encoded as Q8_0 (the default model ships Q4_1)."""

    def __init__(self, source: ModelSource) -> None:
        self._source = source
        self.config = source.config
        self.tokenizer_json = source.tokenizer_json
        self.chat_template = source.chat_template

    def tensor_names(self) -> list[str]:
        return self._source.tensor_names()

    def tensor(self, name: str) -> RawTensor:
        t = self._source.tensor(name)
        if len(t.shape) != 2:
            return t
        q = gguf.quants.quantize(dequantize(t), gguf.GGMLQuantizationType.Q8_0)
        return RawTensor(name, "Q8_0", t.shape, np.ascontiguousarray(q).view(np.uint8).reshape(-1))


@dataclass(frozen=True)
class Row:
    model: str
    weights: str
    graphs: str
    streams: int
    tok_s: float
    wall_ms: float
    device_ms: float | None
    weight_bytes: int
    copy_bw: float

    def cells(self) -> list[str]:
        bw = self.weight_bytes * self.tok_s / self.streams  # a step reads them once
        device = "-" if self.device_ms is None else f"{self.device_ms:.3f}"
        host = "-" if self.device_ms is None else f"{self.wall_ms - self.device_ms:.3f}"
        return [
            self.model,
            self.weights,
            self.graphs,
            str(self.streams),
            f"{self.tok_s:.1f}",
            f"{self.wall_ms:.3f}",
            device,
            host,
            f"{self.weight_bytes / 1e6:.1f} MB",
            f"{bw / 1e9:.1f}",
            f"{100 * bw / self.copy_bw:.0f} %",
        ]


HEADER = [
    "model",
    "weights",
    "graphs",
    "streams",
    "tok/s",
    "wall ms",
    "device ms",
    "host ms",
    "weights/token",
    "GB/s",
    "% copy",
]


def copy_bandwidth(backend: Backend, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s of a large on-device copy, counting the read and the write."""
    xp = backend.xp
    src = xp.ones(nbytes // 4, dtype=xp.float32)
    dst = xp.empty_like(src)
    if backend.name == "cpu":
        best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
        return 2 * nbytes / best
    start, end = xp.cuda.Event(), xp.cuda.Event()
    xp.copyto(dst, src)  # warm-up
    start.record()
    for _ in range(reps):
        xp.copyto(dst, src)
    end.record()
    end.synchronize()
    return 2 * nbytes * reps / (float(xp.cuda.get_elapsed_time(start, end)) / 1e3)


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode(
    stage: Stage, tokens: int, streams: int = 1, prompt: int = 16
) -> tuple[float, float | None]:
    """(wall seconds per step of greedy decode of ``streams`` sequences together, device
    seconds per step or None). The caches are a server stage's: blocks of one pool
    (``kv_pages``), each sequence's read through its block table."""
    c, n = stage.config, prompt + tokens + 2  # + 2 warm-ups
    kv = BlockPool(
        stage.end - stage.start, c.num_kv_heads, c.head_dim, streams * -(-n // KV_BLOCK),
        stage.new_cache(1).k.dtype, xp=stage.xp,
    )  # fmt: skip
    caches = [PagedCache(kv, n) for _ in range(streams)]
    host = stage.backend.to_numpy
    prompts = [BatchRow((np.arange(prompt) + s) % 100 + 10, 0, c, 1) for s, c in enumerate(caches)]
    last = [int(host(out)[-1].argmax()) for out in stage.forward_batch(prompts)]
    pos = prompt

    def step() -> None:
        nonlocal pos
        rows = [BatchRow(np.array([t]), pos, c) for t, c in zip(last, caches, strict=True)]
        last[:] = [int(host(out)[0].argmax()) for out in stage.forward_batch(rows)]
        pos += 1

    for _ in range(2):  # first steps: eager run and graph capture, then a replay
        step()
    t = time.perf_counter()
    for _ in range(tokens):
        step()
    wall = (time.perf_counter() - t) / tokens
    device = stage.replay_seconds(streams, tokens)
    return wall, device


def prefill(stage: Stage, tokens: int = 512) -> float:
    """Wall seconds of one prompt of ``tokens`` tokens (the last row's logits to the host),
    after one such prompt to warm up (the cuBLAS handle, each layer's decode kernels)."""
    host = stage.backend.to_numpy
    prompt = np.arange(tokens) % 100 + 10
    host(stage.forward(prompt, 0, stage.new_cache(tokens), out_rows=1))
    cache = stage.new_cache(tokens)
    t = time.perf_counter()
    host(stage.forward(prompt, 0, cache, out_rows=1))
    return time.perf_counter() - t


def sources(models: list[str], formats: list[str], tiny: bool) -> list[tuple[str, str, Any]]:
    """(model label, weights label, source) of every combination asked for (``tiny``: the
    tiny random model in each format, whatever ``models`` says)."""
    out: list[tuple[str, str, Any]] = []
    dtypes = {"f16": "F16", "q8_0": "Q8_0"}
    if tiny:
        return [("tiny", fmt, RandomSource(TINY, dtypes[fmt])) for fmt in formats]
    for model in models:
        for fmt in formats:
            if model in ("1b", "8b"):
                config = LLAMA_1B if model == "1b" else LLAMA_8B
                out.append((f"llama-{model}-shape", fmt, RandomSource(config, dtypes[fmt])))
            else:
                source = resolve_source(None)
                out.append(("smollm2-135m", fmt, Requantized(source) if fmt == "q8_0" else source))
    return out


def run(args: argparse.Namespace) -> tuple[str, list[Row], list[str]]:
    """The device, every row of the decode table and of the prefill table for ``args``.

    Raises :class:`BackendError` when ``--device cuda`` finds no device.
    """
    backend = select_backend(args.device, "float16" if args.device == "cuda" else "float32")
    bw = copy_bandwidth(backend, nbytes=(64 << 20) if args.tiny else (1 << 30))
    graph_modes = [True, False] if backend.name == "cuda" else [False]
    rows = []
    prompts: list[str] = []  # the prefill table's rows
    for model, fmt, source in sources(args.models.split(","), args.formats.split(","), args.tiny):
        config = ModelConfig.from_hf(source.config)
        for graphs in graph_modes:
            if backend.name == "cuda":
                backend = select_backend("cuda", "float16", cuda_graphs=graphs)
            stage = Stage(
                config, source, 0, config.num_layers, embed=True, head=True, backend=backend
            )
            label = ("on" if graphs else "off") if backend.name == "cuda" else "-"
            nbytes = stage.weights.nbytes()
            if graphs == graph_modes[0] and args.prefill:  # graphs do not take prompts
                seconds = prefill(stage, args.prefill)
                prompts.append(f"{model} | {fmt} | {args.prefill} | {args.prefill / seconds:.0f}")
            for streams in (int(n) for n in args.streams.split(",")):
                wall, device = decode(stage, args.tokens, streams)
                tok_s, ms = streams / wall, wall * 1e3
                rows.append(Row(model, fmt, label, streams, tok_s, ms, _ms(device), nbytes, bw))
            del stage
    return backend.describe(), rows, prompts


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (smoke test)")
    parser.add_argument("--models", default="default,1b", help="default, 1b and/or 8b")
    parser.add_argument("--formats", default="f16,q8_0", help="f16 and/or q8_0")
    parser.add_argument("--tokens", type=int, default=None, help="decode steps timed")
    parser.add_argument(
        "--streams", default="1,8", help="sequences decoded together, one row each: 1,4,16"
    )
    parser.add_argument(
        "--prefill", type=int, default=None, help="prompt tokens timed (0: none; 512)"
    )
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = 8 if args.tiny else 256
    if args.prefill is None:
        args.prefill = 32 if args.tiny else 512
    try:
        device, rows, prompts = run(args)
    except BackendError as exc:
        print(f"benchmarks/gpu.py: needs a CUDA device ({exc}); try --device cpu --tiny")
        return 2
    print(f"device: {device}; copy bandwidth {rows[0].copy_bw / 1e9:.0f} GB/s")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    if prompts:
        print("\n| model | weights | prompt tokens | prefill tok/s |\n|---|---|---|---|")
        for line in prompts:
            print(f"| {line} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
