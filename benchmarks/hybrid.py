"""Hybrid (Gated DeltaNet) model benchmark: verify rows, rollback by ring, n-gram speedup.

Run: ``.venv/bin/python benchmarks/hybrid.py [--tiny] [--repeats 5]``

A randomly initialised Qwen3.5-shaped hybrid model (three DeltaNet layers then one gated
attention layer, repeated; sizes below, ``--tiny`` shrinks them for a smoke run) is built
in memory and run on the CPU backend in this process, one BLAS thread. Three tables, each
measured side by side in one run (medians of ``--repeats``):

1. **Verify rows**: one forward of k + 1 rows (a verify pass of k drafts) against one row
   (a plain decode step) at the same context, and the ratio. The recurrence steps through
   the rows; projections, attention and MLP take them all at once.
2. **Rollback**: after a verify pass of 9 rows, putting the state back to row 3 by the
   snapshot ring (one copy) against re-prefilling the sequence up to there.
3. **n-gram speedup**: greedy generation from repetitive token prompts with n-gram
   speculation (fixed window 4) against plain decoding: tokens/s, accept rate, ratio.
   Every speculative run must give the plain run's tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode_packaging.sources import RawTensor
from threadpoolctl import threadpool_limits

from meshnode.engine.config import ModelConfig
from meshnode.engine.generate import decode_one, prefill
from meshnode.engine.model import Stage
from meshnode.engine.recurrent import HybridCache
from meshnode.engine.sampling import GREEDY
from meshnode.generation.records import Speculation
from meshnode.serve.local import generate_tokens
from meshnode.speculative.ngram import NgramParams, NgramProposer
from meshnode.speculative.window import WindowPolicy

#: Sizes of the timed model: a ~0.3B-parameter slice of a Qwen3.5-style stack, big enough
#: that a forward is dominated by weights and state, not by Python overhead.
FULL = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "intermediate_size": 3072,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "vocab_size": 16384,
}
TINY = {
    **FULL,
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "vocab_size": 256,
}
#: transformers' initializer_range for the layers; the tied embedding gets unit scale, so
#: the residual stream stays close to the input token's embedding and the random model
#: tends to repeat what it reads, as real models do on repetitive prompts: n-gram drafts
#: then get accepted and the last table measures what speculation saves on this stack.
INIT_STD = 0.02
CONTEXT = 256  # tokens already in the cache when verify and decode are timed
# Drafts per timed verify pass. Each repeat rolls back to the pass's start, which the ring
# holds while the pass is shorter than its 17 slots.
WINDOWS = (1, 2, 4, 8, 12)


class RandomHybrid:
    """A randomly initialised hybrid checkpoint in memory (a ``ModelSource``)."""

    def __init__(self, sizes: dict[str, int], seed: int = 0) -> None:
        layers = sizes["num_hidden_layers"]
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        self.config: dict[str, Any] = {
            **sizes,
            "model_type": "qwen3_5_text",
            "layer_types": kinds,
            "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
        }
        self.tokenizer_json = ""
        self.chat_template: str | None = None
        rng = np.random.default_rng(seed)
        self._tensors = {name: _init(rng, name, shape) for name, shape in _shapes(self.config)}

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> RawTensor:
        a = self._tensors[name]
        return RawTensor(name, "F32", a.shape, a.view(np.uint8).reshape(-1))


def _shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    e, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vh, vd = c["linear_num_value_heads"], c["linear_value_head_dim"]
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    out = [("embed_tokens.weight", (v, e)), ("norm.weight", (e,))]
    for i, kind in enumerate(c["layer_types"]):
        p = f"layers.{i}."
        out += [(p + "input_layernorm.weight", (e,)), (p + "post_attention_layernorm.weight", (e,))]
        out += [(p + f"mlp.{n}_proj.weight", (inter, e)) for n in ("gate", "up")]
        out += [(p + "mlp.down_proj.weight", (e, inter))]
        if kind == "linear_attention":
            a = p + "linear_attn."
            out += [
                (a + "in_proj_qkv.weight", (2 * kd + vh * vd, e)),
                (a + "in_proj_z.weight", (vh * vd, e)),
                (a + "in_proj_b.weight", (vh, e)),
                (a + "in_proj_a.weight", (vh, e)),
                (a + "conv1d.weight", (2 * kd + vh * vd, 1, 4)),
                (a + "A_log", (vh,)),
                (a + "dt_bias", (vh,)),
                (a + "norm.weight", (vd,)),
                (a + "out_proj.weight", (e, vh * vd)),
            ]
        else:
            a = p + "self_attn."
            out += [
                (a + "q_proj.weight", (2 * heads * d, e)),
                (a + "k_proj.weight", (kv * d, e)),
                (a + "v_proj.weight", (kv * d, e)),
                (a + "o_proj.weight", (e, heads * d)),
                (a + "q_norm.weight", (d,)),
                (a + "k_norm.weight", (d,)),
            ]
    return out


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return np.ones(shape, np.float32)
    if len(shape) == 1:  # (1 + weight) norms: weight near 0
        return np.zeros(shape, np.float32)
    std = 1.0 if name == "embed_tokens.weight" else INIT_STD
    weights: np.ndarray = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return weights


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def verify_rows(stage: Stage, repeats: int) -> None:
    print(f"\n## Verify pass of k + 1 rows vs one decode row (context {CONTEXT})")
    print("| rows | ms | ratio to 1 row | ms per row |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(1)
    cache = stage.new_cache(CONTEXT + 32)
    stage.forward(rng.integers(0, 200, CONTEXT), 0, cache, out_rows=1)
    base = 0.0
    for k in (0, *WINDOWS):
        ids = rng.integers(0, 200, k + 1)

        def verify(ids: np.ndarray = ids) -> None:
            stage.forward(ids, CONTEXT, cache, out_rows=len(ids))

        s = _median_s(verify, repeats)
        base = base or s
        print(f"| {k + 1} | {s * 1e3:.1f} | {s / base:.2f}x | {s * 1e3 / (k + 1):.1f} |")


def rollback(stage: Stage, repeats: int) -> None:
    print(f"\n## Rollback to row 3 of a 9-row verify pass (context {CONTEXT})")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 200, CONTEXT)
    window = rng.integers(0, 200, 9)
    cache = stage.new_cache(CONTEXT + 32)
    assert isinstance(cache, HybridCache)
    stage.forward(prompt, 0, cache, out_rows=1)

    def by_ring() -> None:
        stage.forward(window, CONTEXT, cache, out_rows=9)  # the pass (not timed below)
        began = time.perf_counter()
        cache.rollback(CONTEXT + 3)
        ring_times.append(time.perf_counter() - began)

    ring_times: list[float] = []
    for _ in range(repeats):
        by_ring()
    ring = statistics.median(ring_times)
    tokens = np.concatenate([prompt, window[:3]])
    fresh = stage.new_cache(CONTEXT + 32)
    replay = _median_s(lambda: stage.forward(tokens, 0, fresh, out_rows=1), repeats)
    print("| method | ms | ratio |")
    print("|---|---|---|")
    print(f"| snapshot ring (copy) | {ring * 1e3:.3f} | 1x |")
    print(f"| re-prefill {len(tokens)} tokens | {replay * 1e3:.1f} | {replay / ring:.0f}x |")
    ring_mib, live_mib = cache.ring_nbytes() / 2**20, cache.recurrent_nbytes() / 2**20
    print(
        f"ring memory per sequence: {ring_mib:.1f} MiB ({cache.ring_slots} slots); "
        f"live recurrent state {live_mib:.2f} MiB"
    )


def greedy(stage: Stage, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding, one row per step (the baseline)."""
    cache = stage.new_cache(len(prompt) + max_tokens)
    out = [int(np.argmax(prefill(stage, cache, prompt)))]
    while len(out) < max_tokens:
        out.append(int(np.argmax(decode_one(stage, cache, out[-1], len(prompt) + len(out) - 1))))
    return out


def ngram_speedup(stage: Stage, repeats: int, max_tokens: int) -> None:
    print(f"\n## n-gram speculation on repetitive token prompts (greedy, {max_tokens} tokens)")
    print("| prompt | plain tok/s | n-gram tok/s | accept rate | ratio |")
    print("|---|---|---|---|---|")
    prompts = {
        "period-5 x 20": [11, 42, 7, 99, 3] * 20,
        "period-12 x 8": list(range(30, 42)) * 8,
    }
    policy = WindowPolicy("fixed", 4, 1, 4)
    for name, prompt in prompts.items():
        plain_ids: list[int] = []
        runs: list[Any] = []

        def plain(prompt: list[int] = prompt, out: list[int] = plain_ids) -> None:
            out[:] = greedy(stage, prompt, max_tokens)

        def spec(prompt: list[int] = prompt, out: list[Any] = runs) -> None:
            proposer = NgramProposer(NgramParams(1, 4))
            out.append(
                generate_tokens(
                    stage,
                    prompt,
                    GREEDY,
                    max_new_tokens=max_tokens,
                    speculation=Speculation.of(proposer, policy),
                )
            )

        t_plain = _median_s(plain, repeats)
        t_spec = _median_s(spec, repeats)
        if runs[-1].state.tokens != plain_ids:
            raise SystemExit(f"{name}: speculation changed the greedy output")
        stats = runs[-1].spec
        rate = stats.accepted / stats.proposed if stats.proposed else 0.0
        n = len(plain_ids)
        print(
            f"| {name} | {n / t_plain:.1f} | {n / t_spec:.1f} | {rate:.2f} | "
            f"{t_plain / t_spec:.2f}x |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model: a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    source = RandomHybrid(sizes)
    config = ModelConfig.from_hf(source.config)
    with threadpool_limits(limits=1, user_api="blas"):
        stage = Stage(config, source, 0, config.num_layers, embed=True, head=True)
        mib = stage.weights.nbytes() / 2**20
        print(
            f"# Hybrid benchmark: random Qwen3.5-shaped model, {mib:.0f} MiB float32, "
            f"{config.num_layers} layers, 1 BLAS thread"
        )
        verify_rows(stage, args.repeats)
        rollback(stage, args.repeats)
        ngram_speedup(stage, max(1, args.repeats // 2), args.max_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
