"""Multi-token prediction (MTP): the hybrid model's own one-layer drafter.

Qwen3.5/Qwen3-Next checkpoints carry an MTP module (``mtp.*``) that predicts the token
after next from the model's final hidden state. It lives on the last stage, where that
state is. For position p it takes the target's final-normed hidden state ``h_p`` and the
embedding of the token at ``p + 1``:

    x = fc([norm_e(embed(t_{p+1})); norm_h(h_p)])      # [2E] -> [E]
    y = norm(decoder_layer(x, position p))              # one gated-attention layer
    logits = head(y)                                    # predicts t_{p+2}

as vLLM's ``qwen3_next_mtp.py`` runs it (the head is the model's). Chained, ``y`` stands in
for the next ``h`` and the draft for the next token, so one module drafts several tokens.
The layer attends over its own KV cache of the committed positions: a :class:`MtpCache`
holds positions ``< length``, and rows a chain wrote past it are cut off on the next call.
Random MTP weights (the test reference) only make bad drafts; acceptance keeps the output.

Shapes: S rows, E hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource

from meshnode.engine import ops
from meshnode.engine.backend import Backend
from meshnode.engine.hybrid import HybridMixer
from meshnode.engine.hybrid_weights import HybridLayerWeights, linear_t, load_layer, offset_norm
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.moe_config import MoeConfig

__all__ = ["MTP_PREFIX", "MtpCache", "MtpHead", "MtpWeights", "has_mtp", "load_mtp_weights"]

MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class MtpWeights:
    """The MTP module; norms are ``1 + weight`` (added at load)."""

    norm_embed: Any  # [E]
    norm_hidden: Any  # [E]
    fc: Any  # [2 E, E]: over the concatenation [norm_e(embed); norm_h(hidden)]
    layer: HybridLayerWeights  # one gated full-attention decoder layer
    norm: Any  # [E]
    embed_t: Any  # [E, V]: the model's embedding (the last stage may not hold it otherwise)


def has_mtp(source: ModelSource) -> bool:
    """Whether the checkpoint carries an MTP module."""
    return f"{MTP_PREFIX}fc.weight" in source.tensor_names()


def load_mtp_weights(
    source: ModelSource, backend: Backend, moe: MoeConfig | None = None
) -> MtpWeights:
    """The ``mtp.*`` tensors and the embedding; ``moe``: the model's experts, which the
    MTP layer has too when it holds a router (Qwen3.5-MoE). Raises ``KeyError`` naming a
    missing tensor."""
    p = MTP_PREFIX
    if f"{p}layers.0.mlp.gate.weight" not in source.tensor_names():
        moe = None  # a dense MLP
    return MtpWeights(
        norm_embed=backend.asarray(offset_norm(source, p + "pre_fc_norm_embedding.weight")),
        norm_hidden=backend.asarray(offset_norm(source, p + "pre_fc_norm_hidden.weight")),
        fc=backend.asarray(linear_t(source, p + "fc.weight")),
        layer=load_layer(source, p + "layers.0.", False, backend, moe),
        norm=backend.asarray(offset_norm(source, p + "norm.weight")),
        embed_t=backend.asarray(linear_t(source, "embed_tokens.weight")),
    )


class MtpCache:
    """One sequence's MTP state: its layer's KV and the newest hidden row waiting for the
    token after it (the last row of a prefill chunk; the next chunk brings that token)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.pending: Any | None = None  # [E] hidden of position kv.length, next token unknown

    @property
    def length(self) -> int:
        """Positions whose (hidden, next token) pair the MTP layer has seen."""
        return self.kv.length


class MtpHead:
    """Runs the MTP module of a head stage (``stage``: its hybrid mixers, whose attention,
    MLP, head and linear product the module's layer shares)."""

    def __init__(self, stage: HybridMixer, weights: MtpWeights) -> None:
        if not stage.head:
            raise ValueError("the MTP module runs on the stage that holds the head")
        self.stage = stage
        self.weights = weights
        self.xp = stage.xp

    def new_cache(self, max_tokens: int) -> MtpCache:
        """An empty MTP cache for one sequence of up to ``max_tokens`` positions."""
        c = self.stage.config
        return MtpCache(KVCache(self.xp, 1, c.num_kv_heads, c.head_dim, max_tokens))

    def absorb(
        self, cache: MtpCache, start: int, hidden: Any, tokens: list[int], following: int | None
    ) -> Any | None:
        """Feed the target's rows at positions ``start ..``; return the last MTP output.

        ``hidden`` ``[S, E]`` are the final-normed target rows, ``tokens`` the S tokens at
        those positions and ``following`` the token after the last (None when not known
        yet: that row waits in :attr:`MtpCache.pending` for the next call). The cache is cut
        back to ``start`` first. Returns the MTP output ``[E]`` of the last position fed, or
        None when nothing was fed (or the cache missed positions before ``start``).
        """
        rows, pos = hidden, start
        nexts = [*tokens[1:], following]
        if cache.pending is not None and cache.length == start - 1:
            rows = self.xp.concatenate([cache.pending[None, :], hidden], axis=0)
            nexts, pos = [tokens[0], *nexts], start - 1
        elif cache.length >= start:
            cache.kv.truncate(start)
        else:  # a gap: positions this cache never saw (MTP drafts nothing for it)
            cache.pending = None
            return None
        cache.pending = None
        if following is None:
            cache.pending, rows = rows[-1], rows[:-1]
        if rows.shape[0] == 0:
            return None
        fed = [int(t) for t in nexts[: rows.shape[0]] if t is not None]
        return self._rows(cache, pos, rows, fed)[-1]

    def draft(self, cache: MtpCache, last_out: Any, count: int) -> list[int]:
        """``count`` greedy drafts following the last fed position, chained from its MTP
        output ``last_out``: each draft's row is written after the committed positions
        (the next :meth:`absorb` cuts them off)."""
        drafts: list[int] = []
        h = last_out
        while True:
            logits = self.logits(h[None, :])[0]  # [V]
            drafts.append(int(self.xp.argmax(logits)))
            pos = cache.kv.length
            if len(drafts) >= count or pos >= cache.kv.max_tokens:
                return drafts
            h = self._rows(cache, pos, h[None, :], [drafts[-1]])[-1]

    def logits(self, out: Any) -> Any:
        """The head over MTP outputs ``[S, E]`` -> ``[S, V]``."""
        return self.stage.linear(out, self._head())

    def _head(self) -> Any:
        w = self.stage.weights
        return w.head_t if w.head_t is not None else w.embed_t

    def _rows(self, cache: MtpCache, pos: int, hidden: Any, next_tokens: list[int]) -> Any:
        """The MTP layer over S rows at positions ``pos ..``; returns ``[S, E]`` (normed)."""
        xp, w, st = self.xp, self.weights, self.stage
        eps = st.config.rms_norm_eps
        ids = xp.asarray(np.asarray(next_tokens, dtype=np.int64))
        emb = w.embed_t[:, ids].T  # [S, E]
        joined = xp.concatenate(
            [
                ops.rms_norm(xp, emb, w.norm_embed, eps),
                ops.rms_norm(xp, hidden, w.norm_hidden, eps),
            ],
            axis=-1,
        )  # [S, 2 E]
        x = st.linear(joined, w.fc)  # [S, E]
        n = x.shape[0]
        cos, sin = ops.rope_cos_sin(xp, st.rope_inv_freq, pos, n)
        layer = w.layer
        assert layer.attention is not None
        h = st.attention(
            layer.attention,
            ops.rms_norm(xp, x, layer.attn_norm, eps),
            pos,
            cache.kv,
            0,
            (cos, sin),
            n,
        )
        x = x + h
        x = x + st.mlp(layer, ops.rms_norm(xp, x, layer.ffn_norm, eps), [n])  # one segment
        cache.kv.length = pos + n
        return ops.rms_norm(xp, x, w.norm, eps)
