"""The hybrid decoder (Qwen3.5: Gated DeltaNet and gated attention layers) as a stage.

Same contract as ``model.Stage`` (which hands its forward here for a hybrid model): layers
``[start, end)``, embedding when first, final norm and head when last, one ``forward`` for
prefill, decode and verify. The cache is a :class:`~meshnode.engine.recurrent.HybridCache`:
``forward`` first rolls it back to ``start_pos`` (KV truncation plus a ring restore), then
every DeltaNet layer keeps its state after each of the pass's last ``ring_slots`` rows.

Batched verify: the projections, the attention and the MLP of a layer run on all rows of
the pass at once; only the delta-rule recurrence steps through the rows one by one.

Shapes: S new rows, r rows whose output is wanted, E hidden, C conv channels, Hk/Hv
DeltaNet key/value heads, Dk/Dv their dims, H/Hkv attention heads, D their dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource

from meshnode.engine import deltanet, ops
from meshnode.engine.backend import Backend
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.hybrid_weights import (
    DeltaNetWeights,
    GatedAttentionWeights,
    HybridLayerWeights,
    linear_t,
    load_layer,
    offset_norm,
)
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS, HybridCache
from meshnode.engine.weights import StageWeights

__all__ = ["HybridStage", "HybridWeights", "load_hybrid_weights"]

Linear = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class HybridWeights(StageWeights):
    """Layers ``[start, end)`` of a hybrid model in :attr:`blocks` (``layers``, the Llama
    blocks, stays empty), plus the embedding and/or the final norm (1 + weight) and head."""

    blocks: list[HybridLayerWeights] = field(default_factory=list)

    def nbytes(self) -> int:
        """Bytes of all weights in this stage."""
        return super().nbytes() + sum(block.nbytes() for block in self.blocks)


def load_hybrid_weights(
    source: ModelSource,
    config: HybridConfig,
    start: int,
    end: int,
    *,
    embed: bool,
    head: bool,
    backend: Backend,
) -> HybridWeights:
    """The tensors of stage ``[start, end)``; raises ``KeyError`` naming a missing one."""
    layers = [
        load_layer(source, f"layers.{i}.", config.is_linear(i), backend) for i in range(start, end)
    ]
    tied = config.tie_word_embeddings or "lm_head.weight" not in source.tensor_names()
    embed_t = None
    if embed or (head and tied):
        embed_t = backend.asarray(linear_t(source, "embed_tokens.weight"))
    head_t = None
    if head and not tied:
        head_t = backend.asarray(linear_t(source, "lm_head.weight"))
    norm = backend.asarray(offset_norm(source, "norm.weight")) if head else None
    return HybridWeights(start, end, [], embed_t, norm, head_t, blocks=layers)


class HybridStage:
    """The forward of a hybrid stage; ``linear`` is the stage's ``x @ w`` helper."""

    def __init__(
        self,
        config: HybridConfig,
        weights: HybridWeights,
        start: int,
        end: int,
        *,
        embed: bool,
        head: bool,
        backend: Backend,
        linear: Linear,
        ring_slots: int = DEFAULT_RING_SLOTS,
    ) -> None:
        self.config = config
        self.weights = weights
        self.start, self.end = start, end
        self.embed, self.head = embed, head
        self.xp = backend.xp
        self.linear = linear
        self.ring_slots = ring_slots
        # Index of each layer among the stage's DeltaNet (or attention) layers.
        kinds = [config.is_linear(i) for i in range(start, end)]
        self._slot = [sum(kinds[:i]) if k else i - sum(kinds[:i]) for i, k in enumerate(kinds)]
        self.linear_layers = sum(kinds)
        self.attention_layers = len(kinds) - self.linear_layers
        inv_freq = np.asarray(config.rope_inv_freq(), dtype=np.float32)
        self.rope_inv_freq = backend.asarray(inv_freq)  # [R/2] (the MTP layer's too)
        # Head stage with an MTP module: the final-normed hidden rows of the last pass, all
        # of them when ``keep_hidden`` is set (the MTP layer reads every committed row).
        self.keep_hidden = False
        self.last_hidden: Any = None  # [S, E]
        self._scale = float(1.0 / np.sqrt(config.head_dim))

    def new_cache(self, max_tokens: int) -> HybridCache:
        """An empty cache for one sequence of up to ``max_tokens`` positions."""
        c = self.config
        return HybridCache(
            self.xp,
            self.attention_layers,
            c.num_kv_heads,
            c.head_dim,
            max_tokens,
            linear_layers=self.linear_layers,
            shape=c.recurrent_shape(),
            ring_slots=self.ring_slots,
        )

    def forward(
        self, inputs: Any, start_pos: int, cache: HybridCache, *, out_rows: int | None = None
    ) -> Any:
        """Run S new positions from ``start_pos``; see ``model.Stage.forward``.

        Raises ``RollbackError`` when ``start_pos`` is behind the snapshot ring and
        ``ValueError`` when it is past the cache's end or the cache is full.
        """
        cache.rollback(start_pos)
        xp = self.xp
        x = self.embed_rows(inputs) if self.embed else xp.asarray(inputs, xp.float32)
        n = x.shape[0]
        rows = n if out_rows is None or not self.head else min(out_rows, n)
        wanted = rows
        if self.keep_hidden and self.head:
            rows = n
        cos, sin = ops.rope_cos_sin(xp, self.rope_inv_freq, start_pos, n)  # [S, R]
        last = len(self.weights.blocks) - 1
        for i, layer in enumerate(self.weights.blocks):
            keep = rows if i == last else n
            x = self._block(layer, self._slot[i], x, start_pos, cache, (cos, sin), keep)
        if not self.weights.blocks:
            x = x[n - rows :]
        cache.advance(start_pos, n)
        if not self.head:
            return x
        self.last_hidden = self.final_norm(x)  # [r, E]
        return self._project(self.last_hidden[rows - wanted :])

    # -- pieces ------------------------------------------------------------------------

    def _block(
        self,
        w: HybridLayerWeights,
        slot: int,
        x: Any,
        pos: int,
        cache: HybridCache,
        rope: tuple[Any, Any],
        rows: int,
    ) -> Any:
        """One decoder layer; only the last ``rows`` rows go past the token mixer."""
        n = x.shape[0]
        h = self._norm(x, w.attn_norm)
        if w.linear is not None:
            h = self._deltanet(w.linear, h, slot, pos, cache, rows)
        else:
            assert w.attention is not None
            h = self.attention(w.attention, h, pos, cache, slot, rope, rows)
        x = x[n - rows :] + h  # [r, E]
        return x + self.mlp(w, self._norm(x, w.ffn_norm))

    def _deltanet(
        self, w: DeltaNetWeights, x: Any, slot: int, pos: int, cache: HybridCache, rows: int
    ) -> Any:
        c, xp = self.config, self.xp
        n = x.shape[0]
        qkv = self.linear(x, w.in_qkv)  # [S, C]
        ba = self.linear(x, w.in_ba)  # [S, 2 Hv]
        window = xp.concatenate([cache.conv[slot], qkv], axis=0)  # [K-1+S, C]
        mixed = deltanet.causal_conv(xp, window, w.conv)  # [S, C]
        q = mixed[:, : c.key_size].reshape(n, c.linear_key_heads, c.linear_key_dim)
        k = mixed[:, c.key_size : 2 * c.key_size].reshape(n, c.linear_key_heads, c.linear_key_dim)
        v = mixed[:, 2 * c.key_size :].reshape(n, c.linear_value_heads, c.linear_value_dim)
        heads = c.linear_value_heads
        g, beta = deltanet.decay_and_beta(xp, ba[:, heads:], ba[:, :heads], w.a_log, w.dt_bias)
        keep_from = max(0, n - cache.ring_slots)
        out, state, kept = deltanet.gated_delta_rule(
            xp, q, k, v, g, beta, cache.state[slot], keep_from=keep_from
        )
        taps = cache.conv.shape[1]
        for j, snapshot in enumerate(kept):
            t = keep_from + j  # the state after row t: conv window ends at input row t
            cache.keep(slot, pos + t, window[t + 1 : t + 1 + taps], snapshot)
        cache.conv[slot] = window[n:]
        cache.state[slot] = state
        z = self.linear(x[n - rows :], w.in_z).reshape(rows, heads, c.linear_value_dim)
        o = deltanet.gated_rms_norm(xp, out[n - rows :], z, w.norm, c.rms_norm_eps)
        return self.linear(o.reshape(rows, c.value_size), w.out)  # [r, E]

    def attention(
        self,
        w: GatedAttentionWeights,
        x: Any,
        pos: int,
        kv: KVCache,
        layer: int,
        rope: tuple[Any, Any],
        rows: int,
    ) -> Any:
        """Gated attention of the last ``rows`` of ``x`` ``[S, E]``; writes K/V of all S."""
        c, xp = self.config, self.xp
        n, d, heads = x.shape[0], c.head_dim, c.num_heads
        cos, sin = rope
        qkv = self.linear(x, w.wqkv)  # [S, 2 H D + 2 Hkv D]
        qg = qkv[n - rows :, : 2 * heads * d].reshape(rows, heads, 2 * d)  # [r, H, 2 D]
        gate = qg[:, :, d:].reshape(rows, heads * d)
        q = self._norm(qg[:, :, :d], w.q_norm).transpose(1, 0, 2)  # [H, r, D]
        kv_rows = qkv[:, 2 * heads * d :].reshape(n, 2, c.num_kv_heads, d)
        k = self._norm(kv_rows[:, 0], w.k_norm).transpose(1, 0, 2)  # [Hkv, S, D]
        v = kv_rows[:, 1].transpose(1, 0, 2)
        q = deltanet.partial_rotate_half(xp, q, cos[n - rows :], sin[n - rows :])
        k = deltanet.partial_rotate_half(xp, k, cos, sin)
        keys, values = kv.write(layer, pos, k, v)  # [Hkv, T, D]
        out = ops.attention(xp, q, keys, values, self._scale)  # [H, r, D]
        out = out.transpose(1, 0, 2).reshape(rows, heads * d) * deltanet.sigmoid(xp, gate)
        return self.linear(out, w.wo)  # [r, E]

    def mlp(self, w: HybridLayerWeights, x: Any) -> Any:
        """SwiGLU of ``x`` ``[r, E]``."""
        gate_up = self.linear(x, w.w_gate_up)  # [r, 2 I]
        return self.linear(ops.silu_mul(self.xp, gate_up), w.w_down)

    def embed_rows(self, ids: Any) -> Any:
        """The embeddings ``[S, E]`` of token ids ``[S]``."""
        table = self.weights.embed_t
        assert table is not None
        return table[:, self.xp.asarray(ids, dtype=self.xp.int64)].T

    def final_norm(self, x: Any) -> Any:
        """The final RMSNorm (head stage)."""
        assert self.weights.norm is not None
        return self._norm(x, self.weights.norm)

    def logits(self, x: Any) -> Any:
        """Final norm and output head: ``[r, E]`` -> ``[r, V]``."""
        return self._project(self.final_norm(x))

    def _project(self, normed: Any) -> Any:
        w = self.weights
        return self.linear(normed, w.head_t if w.head_t is not None else w.embed_t)

    def _norm(self, x: Any, weight: Any) -> Any:
        return ops.rms_norm(self.xp, x, weight, self.config.rms_norm_eps)
