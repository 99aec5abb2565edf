"""The bottom rungs of generation over one stage (after gpt-fast's generate.py).

``prefill`` → ``decode_one``: logits for the next token, nothing else. The generation loop
(sampling, speculation, stop strings, EOS and budget) is one, over a pipeline:
:func:`meshnode.generation.driver.generate`, which ``meshnode generate`` drives over a local
pipeline (:mod:`meshnode.serve.local`); these rungs are what tests compare it with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import Stage

__all__ = ["PREFILL_CHUNK", "decode_one", "prefill"]

# Prompt tokens per forward during prefill (llama.cpp's default batch is also 512): the
# attention scores of one chunk are [H, chunk, T] floats, so an 8k-token prompt in one
# forward would need 2+ GB for them; in chunks of 512 it needs 1/16 of that.
PREFILL_CHUNK = 512


def prefill(
    stage: Stage, cache: KVCache, prompt_ids: Sequence[int], chunk: int = PREFILL_CHUNK
) -> np.ndarray:
    """Run the prompt from position 0 in chunks; return the next-token logits ``[V]``."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    for start in range(0, len(ids), chunk):
        logits = stage.forward(ids[start : start + chunk], start, cache, out_rows=1)
    return stage.backend.to_numpy(logits[-1])


def decode_one(stage: Stage, cache: KVCache, token: int, pos: int) -> np.ndarray:
    """Feed one token at ``pos``; return the next-token logits ``[V]``."""
    logits = stage.forward(np.asarray([token], dtype=np.int64), pos, cache)
    return stage.backend.to_numpy(logits[-1])
