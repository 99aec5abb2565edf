"""Where a resumed chat turn's time goes (issue 30: flat turns), in thread CPU time.

Run: ``.venv/bin/python benchmarks/prefix_profile.py [--turns 2 10] [--repeat 5]
[--dtype q8] [--threads 1]``

One stage holds SmolLM2-135M in its GGUF blocks (``--dtype native``, the default here;
``q8`` is what ``meshnode join`` runs on a CPU, with float16 K/V: ``--kv-dtype auto``),
kernel and BLAS threads at ``--threads`` (one by default; ``meshnode join`` runs one per
core). For each turn of ``benchmarks/prefix.py``'s chat, the parts of its
first token with the cache on, each the least of ``--repeat`` runs (on a busy machine the
least disturbed; medians swing by 20% at a load of 10): templating and
tokenizing the whole conversation, the hash chain of its blocks, a hit on the cached
prefix's blocks (those of the previous turn's prompt that this one repeats: a released
paged cache takes them into its block table, by reference), and the suffix's prefill from
the end of the cached prefix, with its attention (the compiled kernel's calls,
``KernelAttention``, which read the keys and values through the block table; and the BLAS
path's ``blocked_attention``, where the kernel cannot run) and the writes and reads of the
sequence's K/V for the BLAS path (``PagedCache.write``: the gather, float16 widened) apart.
CPU time of this process (all its threads), so the figures hold on a busy machine;
``uptime`` is printed first and last.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prefix import conversation, uptime
from meshnode.engine import attention
from meshnode.engine.backend import cpu_backend, limit_cpu_threads
from meshnode.engine.kv_cache import resolve_kv_dtype
from meshnode.engine.kv_pages import BlockPool, PagedCache
from meshnode.engine.loader import load_model
from meshnode.engine.model import Stage, token_ids
from meshnode.engine.prefix_cache import PrefixPool, chain_keys, resume_length
from meshnode.generation.records import DEFAULT_PREFILL_CHUNK_TOKENS
from meshnode.serve.single import EngineCodec
from tests.conftest import smollm2_gguf_path

CONTEXT = 4096


def cpu_ms(fn: Callable[[], Any], repeat: int, before: Callable[[], Any] = lambda: None) -> float:
    """The least process CPU milliseconds of ``fn()`` over ``repeat`` runs (``before()``
    first, untimed, each time)."""
    times = []
    for _ in range(repeat):
        before()
        began = time.process_time()
        fn()
        times.append(1000 * (time.process_time() - began))
    return min(times)


def render(codec: EngineCodec, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's prompt ids, as the host templates and tokenizes it."""
    return codec.encode(codec.render_chat(messages))


def prefill(stage: Stage, cache: Any, tokens: list[int], start: int) -> None:
    """The host's prefill of ``tokens`` from ``start``: chunks, one logits row at the end."""
    for at in range(0, len(tokens), DEFAULT_PREFILL_CHUNK_TOKENS):
        chunk = tokens[at : at + DEFAULT_PREFILL_CHUNK_TOKENS]
        stage.forward(token_ids(chunk), start + at, cache, out_rows=1)


def _timed(fn: Callable[..., Any], spent: list[float], i: int) -> Callable[..., Any]:
    """``fn``, adding the process CPU milliseconds of each call to ``spent[i]``."""

    def timed(*a: Any, **k: Any) -> Any:
        began = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            spent[i] += 1000 * (time.process_time() - began)

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 10])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", choices=["native", "q8"], default="native")
    parser.add_argument("--kv-dtype", choices=["auto", "f32", "f16"], default="auto")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print("uptime:", uptime(), flush=True)
    limit = limit_cpu_threads(args.threads)
    kv_dtype = resolve_kv_dtype(args.kv_dtype, args.dtype)
    print(f"weights {args.dtype}, K/V {kv_dtype}, {args.threads} threads", flush=True)
    model = load_model(str(smollm2_gguf_path()), cpu_backend(args.dtype), kv_dtype)
    stage, c = model.stage, model.config
    codec = EngineCodec(model.tokenizer, model.chat_template, c.vocab_size)
    chats = list(conversation(max(args.turns)))
    blocks = 4 * CONTEXT // 32  # two sequences' contexts and two cached
    kv = BlockPool(c.num_layers, c.num_kv_heads, c.head_dim, blocks, stage.new_cache(1).k.dtype)
    pool = PrefixPool(kv, "profile", blocks // 2)
    cache, seq = PagedCache(kv, CONTEXT), PagedCache(kv, CONTEXT)
    prefill(stage, cache, [1, 2, 3], 0)  # compile the kernels
    spent = [0.0, 0.0]  # ms in the attention (kernel and BLAS path), in PagedCache.write
    kernel = attention.KernelAttention
    kernel.__call__ = _timed(kernel.__call__, spent, 0)  # type: ignore[method-assign]
    PagedCache.write = _timed(PagedCache.write, spent, 1)  # type: ignore[method-assign]
    print("turn | prompt | cached | template+tokens | chain | hit | suffix (attention, K/V) ms")
    for turn in args.turns:
        messages = chats[turn - 1]
        ids = render(codec, messages)
        template = cpu_ms(partial(render, codec, messages), args.repeat)
        chain = cpu_ms(partial(chain_keys, "profile", ids), args.repeat)
        # what the previous turn left in the pool: the blocks of its prompt this one repeats
        before = render(codec, chats[turn - 2]) if turn > 1 else []
        pairs = enumerate(zip(before, ids, strict=False))
        same = next((i for i, (a, b) in pairs if a != b), min(len(before), len(ids)))
        start = resume_length(len(ids), same // pool.block, pool.block)
        cache.truncate(0)
        prefill(stage, cache, ids[:start], 0)
        keys = pool.store(ids[:start], cache, 0) if start else []
        hit = 0.0
        if keys:
            hit = cpu_ms(partial(pool.acquire, keys[-1], seq), args.repeat, seq.release_pages)
        suffix, parts = [], []
        for _ in range(args.repeat):  # from the hit: the cached blocks in the table
            if keys:
                seq.release_pages()
                pool.acquire(keys[-1], seq)
            into = seq if keys else cache
            into.truncate(start)
            spent[:] = [0.0, 0.0]
            suffix.append(cpu_ms(partial(prefill, stage, into, ids[start:], start), 1))
            parts.append(list(spent))
        seq.release_pages()
        pool.clear()
        attn, rw = parts[suffix.index(min(suffix))]
        print(
            f"{turn:4} | {len(ids):6} | {start:6} | {template:15.1f} | {chain:5.2f} | {hit:3.1f}"
            f" | {min(suffix):7.0f} ({attn:.0f}, {rw:.0f})",
            flush=True,
        )
    print("uptime:", uptime(), "threads handle:", type(limit).__name__)


if __name__ == "__main__":
    main()
