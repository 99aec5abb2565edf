"""The hybrid decoder's token mixers (Qwen3.5: Gated DeltaNet and gated attention layers).

``model.Stage`` runs a hybrid model with the same block as any other: norm, token mixer,
residual, norm, SwiGLU, residual; :class:`HybridMixer` is the mixer part, chosen per
layer by its weights. The cache is a :class:`~meshnode.engine.recurrent.HybridCache`:
the stage first rolls it back to ``start_pos`` (KV truncation plus a ring restore), then
every DeltaNet layer keeps its state after each of the pass's last ``ring_slots`` rows.

Batched verify: the projections and the MLP of a layer run on all rows of the pass at
once; the delta-rule recurrence steps through the rows one by one. The gated attention of
a short pass (up to ``KERNEL_MAX_ROWS`` rows: decode, a verify window) runs in the CPU's
compiled kernel over GGUF blocks (:func:`~meshnode.engine.attention.rotated_attention`,
the queries and keys normed and rotated here), elsewhere in the reference a row at a time
(:func:`~meshnode.engine.attention.reference_heads`): either way a verify window's rows
are the bits of its decode steps.

Shapes: S new rows, r rows whose output is wanted, E hidden, C conv channels, Hk/Hv
DeltaNet key/value heads, Dk/Dv their dims, H/Hkv attention heads, D their dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from meshnode_packaging.sources import ModelSource

from meshnode.engine import deltanet, ops
from meshnode.engine.attention import (
    KERNEL_MAX_ROWS,
    Segment,
    reference_heads,
    rotated_attention,
)
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
from meshnode.engine.moe import moe_mlp
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS, HybridCache
from meshnode.engine.weights import StageWeights

__all__ = ["HybridMixer", "HybridWeights", "load_hybrid_weights"]


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
    moe = config.moe
    layers = [
        load_layer(
            source,
            f"layers.{i}.",
            config.is_linear(i),
            backend,
            moe if moe is not None and moe.is_sparse(i) else None,
        )
        for i in range(start, end)
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


class HybridMixer:
    """The token mixers of a hybrid stage's layers, for ``model.Stage``'s one forward: a
    DeltaNet layer's recurrence or a gated-attention layer's attention, each chosen by the
    layer's weights. ``linear`` is the backend's ``x @ w``. The MTP head
    (``meshnode.engine.mtp``) runs its layer through :meth:`attention` and :meth:`mlp`."""

    def __init__(
        self,
        config: HybridConfig,
        weights: HybridWeights,
        start: int,
        end: int,
        *,
        head: bool,
        backend: Backend,
        ring_slots: int = DEFAULT_RING_SLOTS,
    ) -> None:
        self.config = config
        self.weights = weights
        self.head = head
        self.backend = backend
        self.xp = backend.xp
        self.linear = backend.linear
        self.ring_slots = ring_slots
        # Index of each layer among the stage's DeltaNet (or attention) layers.
        kinds = [config.is_linear(i) for i in range(start, end)]
        self._slot = [sum(kinds[:i]) if k else i - sum(kinds[:i]) for i, k in enumerate(kinds)]
        self.linear_layers = sum(kinds)
        self.attention_layers = len(kinds) - self.linear_layers
        inv_freq = np.asarray(config.rope_inv_freq(), dtype=np.float32)
        self.rope_inv_freq = backend.asarray(inv_freq)  # [R/2] (the MTP layer's too)
        self._scale = float(1.0 / np.sqrt(config.head_dim))
        # whether short passes' attention takes the compiled kernel (rotated_attention),
        # which steps over the head dimension sixteen lanes at a time
        self._kernel = backend.cpu_blocks and config.head_dim % 16 == 0

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

    def prepare(self, segs: Sequence[Segment]) -> list[tuple[Any, Any]]:
        """RoPE's cos and sin ``[S, R]`` of each segment's positions (``Stage``'s plan)."""
        inv = self.rope_inv_freq
        return [ops.rope_cos_sin(self.xp, inv, seg.start_pos, seg.n) for seg in segs]

    def keep_rows(self, x: Any, segs: Sequence[Segment], plan: Any) -> Any:
        """Each segment's last ``rows`` rows of ``x`` ``[N, E]``."""
        return _concat(self.xp, [p[seg.n - seg.rows :] for p, seg in _parts(x, segs)])

    def __call__(
        self,
        w: HybridLayerWeights,
        x: Any,
        segs: Sequence[Segment],
        plan: list[tuple[Any, Any]],
        layer: int,
        last: bool,
    ) -> Any:
        """Stage layer ``layer``'s token mixer over ``x`` ``[N, E]`` (normed): ``[R, E]``,
        every row, or in the ``last`` layer each segment's last ``rows``."""
        slot = self._slot[layer]
        if w.linear is not None:
            return self._deltanet(w.linear, x, slot, segs, last)
        assert w.attention is not None
        # all rows at once, each segment's by the path they take alone (Backend.linear)
        qkv = self.linear(x, w.attention.wqkv, [seg.n for seg in segs])  # [N, 2 H D + 2 Hkv D]
        outs = [
            self._attend(w.attention, part, seg.start_pos, seg.cache, slot, rope, _kept(seg, last))
            for (part, seg), rope in zip(_parts(qkv, segs), plan, strict=True)
        ]
        kept = [_kept(seg, last) for seg in segs]
        return self.linear(_concat(self.xp, outs), w.attention.wo, kept)  # [R, E]

    def _deltanet(
        self, w: DeltaNetWeights, x: Any, slot: int, segs: Sequence[Segment], last: bool
    ) -> Any:
        c, xp = self.config, self.xp
        sizes = [seg.n for seg in segs]  # each segment's rows by their own path
        qkv = self.linear(x, w.in_qkv, sizes)  # [N, C]
        ba = self.linear(x, w.in_ba, sizes)  # [N, 2 Hv]
        outs, kept_x = [], []
        for (qkv_seg, seg), (ba_seg, _), (x_seg, _) in zip(
            _parts(qkv, segs), _parts(ba, segs), _parts(x, segs), strict=True
        ):
            rows = _kept(seg, last)
            out = self._recur(w, qkv_seg, ba_seg, slot, seg.start_pos, seg.cache)
            outs.append(out[seg.n - rows :])
            kept_x.append(x_seg[seg.n - rows :])
        out, x = _concat(xp, outs), _concat(xp, kept_x)  # [R, Hv, Dv], [R, E]
        r, heads = out.shape[0], c.linear_value_heads
        kept = [_kept(seg, last) for seg in segs]
        z = self.linear(x, w.in_z, kept).reshape(r, heads, c.linear_value_dim)
        o = deltanet.gated_rms_norm(xp, out, z, w.norm, c.rms_norm_eps)
        return self.linear(o.reshape(r, c.value_size), w.out, kept)  # [R, E]

    def _recur(
        self, w: DeltaNetWeights, qkv: Any, ba: Any, slot: int, pos: int, cache: HybridCache
    ) -> Any:
        """One sequence's convolution and delta rule over its S rows ``[S, C]``: the outputs
        ``[S, Hv, Dv]``; the layer's state, conv window and ring snapshots move on."""
        c, xp = self.config, self.xp
        n = qkv.shape[0]
        window = xp.concatenate([cache.conv[slot], qkv], axis=0)  # [K-1+S, C]
        mixed = deltanet.causal_conv(xp, window, w.conv)  # [S, C]
        q = mixed[:, : c.key_size].reshape(n, c.linear_key_heads, c.linear_key_dim)
        k = mixed[:, c.key_size : 2 * c.key_size].reshape(n, c.linear_key_heads, c.linear_key_dim)
        v = mixed[:, 2 * c.key_size :].reshape(n, c.linear_value_heads, c.linear_value_dim)
        heads = c.linear_value_heads
        g, beta = deltanet.decay_and_beta(xp, ba[:, heads:], ba[:, :heads], w.neg_a, w.dt_bias)
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
        return out

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
        out = self._attend(w, self.linear(x, w.wqkv), pos, kv, layer, rope, rows)
        return self.linear(out, w.wo)  # [r, E]

    def _attend(
        self,
        w: GatedAttentionWeights,
        qkv: Any,
        pos: int,
        kv: KVCache,
        layer: int,
        rope: tuple[Any, Any],
        rows: int,
    ) -> Any:
        """One sequence's gated attention from its projections ``qkv`` ``[S, 2 H D +
        2 Hkv D]``: the gated outputs of its last ``rows`` rows ``[r, H D]`` (before ``wo``);
        writes K/V of all S."""
        c, xp = self.config, self.xp
        n, d, heads = qkv.shape[0], c.head_dim, c.num_heads
        cos, sin = rope
        qg = qkv[n - rows :, : 2 * heads * d].reshape(rows, heads, 2 * d)  # [r, H, 2 D]
        gate = qg[:, :, d:].reshape(rows, heads * d)
        q = self._norm(qg[:, :, :d], w.q_norm).transpose(1, 0, 2)  # [H, r, D]
        kv_rows = qkv[:, 2 * heads * d :].reshape(n, 2, c.num_kv_heads, d)
        k = self._norm(kv_rows[:, 0], w.k_norm).transpose(1, 0, 2)  # [Hkv, S, D]
        v = kv_rows[:, 1].transpose(1, 0, 2)
        q = deltanet.partial_rotate_half(xp, q, cos[n - rows :], sin[n - rows :])
        k = deltanet.partial_rotate_half(xp, k, cos, sin)
        if self._kernel and n <= KERNEL_MAX_ROWS:  # [S, (H + 2 Hkv) D], the kernel's layout
            q_size, kv_size = heads * d, c.num_kv_heads * d
            rotated = np.zeros((n, q_size + 2 * kv_size), np.float32)
            rotated[n - rows :, :q_size] = q.transpose(1, 0, 2).reshape(rows, q_size)
            rotated[:, q_size : q_size + kv_size] = k.transpose(1, 0, 2).reshape(n, kv_size)
            rotated[:, q_size + kv_size :] = v.transpose(1, 0, 2).reshape(n, kv_size)
            out = rotated_attention(rotated, pos, rows, kv, layer, heads, self._scale)
            return out * deltanet.sigmoid(xp, gate)  # [r, H D]
        keys, values = kv.write(layer, pos, k, v)  # [Hkv, T, D]
        out = reference_heads(xp, q, keys, values, self._scale)  # [H, r, D]
        return out.transpose(1, 0, 2).reshape(rows, heads * d) * deltanet.sigmoid(xp, gate)

    def mlp(self, w: HybridLayerWeights, x: Any, sizes: Sequence[int] | None = None) -> Any:
        """SwiGLU of ``x`` ``[r, E]`` (the routed experts in a mixture-of-experts layer);
        ``sizes``: the row counts of the segments in ``x`` (one without), each row's
        products by the path its segment takes alone (:meth:`Backend.linear`)."""
        sizes = [x.shape[0]] if sizes is None else list(sizes)
        if w.moe is not None:  # MoE: this layer's feed-forward kind is routed experts
            assert self.config.moe is not None
            return moe_mlp(self.backend, self.config.moe, w.moe, x, sizes)  # [r, E]
        gate_up = self.linear(x, w.w_gate_up, sizes)  # [r, 2 I]
        return self.linear(ops.silu_mul(self.xp, gate_up), w.w_down, sizes)

    def _norm(self, x: Any, weight: Any) -> Any:
        return ops.rms_norm(self.xp, x, weight, self.config.rms_norm_eps)


def _kept(seg: Segment, last: bool) -> int:
    """Rows of ``seg`` that go past the token mixer: all but in the last layer."""
    return seg.rows if last else seg.n


def _parts(x: Any, segs: Sequence[Segment]) -> list[tuple[Any, Segment]]:
    """``x``'s rows cut per segment (``n`` rows each)."""
    out, offset = [], 0
    for seg in segs:
        out.append((x[offset : offset + seg.n], seg))
        offset += seg.n
    return out


def _concat(xp: Any, parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)
