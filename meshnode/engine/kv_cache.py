"""Per-sequence KV cache: preallocated, written in place, rolled back by truncation."""

from __future__ import annotations

from typing import Any

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of one sequence for the layers of one stage.

    Arrays are ``[L, Hkv, T, D]`` with ``T = max_tokens`` allocated up front, so decode
    never reallocates and a sequence that starts cannot run out of memory halfway. Only
    the first :attr:`length` positions are valid; truncating is O(1) (speculative
    decoding rolls back rejected drafts this way). ``dtype`` is float32 on the CPU; the
    CUDA stage may keep float16 bit patterns (``uint16``) and writes them itself.
    """

    def __init__(
        self,
        xp: Any,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        *,
        dtype: Any = None,
    ):
        dtype = xp.float32 if dtype is None else dtype
        self.max_tokens = max_tokens
        self.k = xp.zeros((layers, kv_heads, max_tokens, head_dim), dtype=dtype)
        self.v = xp.zeros((layers, kv_heads, max_tokens, head_dim), dtype=dtype)
        self.length = 0

    def truncate(self, n: int) -> None:
        """Forget every position from ``n`` on; raises ``ValueError`` if ``n > length``."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def write(self, layer: int, start: int, k: Any, v: Any) -> tuple[Any, Any]:
        """Store ``k, v`` ``[Hkv, S, D]`` at ``start``; return keys/values ``[Hkv, T', D]``.

        ``T' = start + S``: every position the new queries may attend to.
        """
        end = start + k.shape[1]
        if end > self.max_tokens:
            raise ValueError(f"KV cache full: {end} > {self.max_tokens} tokens")
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def nbytes(self) -> int:
        """Bytes allocated for this cache."""
        return int(self.k.nbytes + self.v.nbytes)
