"""The decoder as a pipeline stage: layers ``[start, end)`` of one model.

One block serves every family in ``config.ARCHITECTURES``: Llama's pre-norm block, plus
what the model's row switches on (QK-norm, norms on the attention and MLP outputs,
GeGLU, scaled embeddings, sliding-window layers with their own RoPE base). A stage embeds
token ids when it is the first stage and applies the final norm and the output head when
it is the last. One ``forward`` handles prefill (many new tokens), decode
(one) and verify (k + 1) alike: new tokens attend causally to the cache and to each other.
On a CUDA backend the stage hands its forward to ``meshnode.engine.cuda.stage`` (the same
math as the functions of ``meshnode.engine.ops`` this file calls, as fused kernels).

Shapes: S new tokens, T cached + new positions, E hidden size, H query heads, Hkv key/value
heads, G = H / Hkv, D head dim, V vocabulary, r rows whose output is wanted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from meshnode_packaging.sources import ModelSource

from meshnode.engine import ops
from meshnode.engine.backend import Backend, cpu_backend
from meshnode.engine.config import ModelConfig, ModelConfigError
from meshnode.engine.cpu import BlockMatrix
from meshnode.engine.hybrid import HybridStage, load_hybrid_weights
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.mtp import MtpHead, has_mtp, load_mtp_weights
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS, HybridCache
from meshnode.engine.weights import LayerWeights, StageWeights, load_stage_weights

if TYPE_CHECKING:
    from meshnode.engine.cuda.stage import CudaStage

__all__ = ["GEMV_MAX_ROWS", "Stage"]

# On CPU a one-row product is an sgemv that streams W at memory bandwidth, but OpenBLAS's
# sgemm with 2-4 rows costs about 3x that, while a second sgemv right after the first finds
# W in the L3 cache and costs about 0.5x more (benchmarks/engine.py, "k-token forward").
# So products of up to this many rows run row by row; verify windows of 1-2 drafts gain most.
GEMV_MAX_ROWS = 3


class Stage:
    """Layers ``[start, end)`` of a model, with the embedding and/or head if asked for."""

    def __init__(
        self,
        config: ModelConfig,
        source_or_weights: ModelSource | StageWeights,
        start: int,
        end: int,
        *,
        embed: bool,
        head: bool,
        backend: Backend | None = None,
        ring_slots: int = DEFAULT_RING_SLOTS,
        mtp: bool = True,
    ) -> None:
        if not 0 <= start <= end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside 0..{config.num_layers}")
        self.config = config
        self.start, self.end = start, end
        self.embed, self.head = embed, head
        self.backend = backend or cpu_backend()
        if self.backend.name == "cuda" and not config.arch.cuda:
            raise ModelConfigError(
                f"the CUDA stage does not run {config.model_type} models yet (use --device cpu)"
            )
        self.xp = self.backend.xp
        # block kernels multiply every row in one pass over the weights: never row by row
        dense_cpu = self.backend.name == "cpu" and not self.backend.cpu_blocks
        self.gemv_max_rows = GEMV_MAX_ROWS if dense_cpu else 1
        self._cuda: CudaStage | None = None
        self.hybrid: HybridStage | None = None
        self.mtp: MtpHead | None = None  # the model's MTP drafter (hybrid head stage)
        if config.hybrid is not None:  # Gated DeltaNet + gated attention layers
            self._init_hybrid(config.hybrid, source_or_weights, ring_slots, mtp)
            return
        if isinstance(source_or_weights, StageWeights):
            self.weights = source_or_weights
        else:
            self.weights = load_stage_weights(
                source_or_weights,
                config,
                start,
                end,
                embed=embed,
                head=head,
                backend=self.backend,
            )
        # RoPE frequencies [D/2] of each distinct kind of layer (Gemma 3: local and global),
        # and which kind each layer of the stage is.
        kinds = [tuple(config.rope_inv_freq(i)) for i in range(start, end)]
        distinct = list(dict.fromkeys(kinds))
        self._freqs = [self.backend.asarray(np.asarray(f, dtype=np.float32)) for f in distinct]
        self._rope_kind = [distinct.index(k) for k in kinds]
        self._windows = [config.window(i) for i in range(start, end)]
        self._scale = config.attention_scale
        # Gemma scales embeddings by sqrt(hidden) rounded to the activations' dtype first.
        self._embed_scale = np.float32(np.sqrt(config.hidden_size))
        if self.backend.name == "cuda":  # the engine's kernels, fixed buffers, CUDA graphs
            from meshnode.engine.cuda.stage import CudaStage

            self._cuda = CudaStage(
                config, self.weights, embed=embed, head=head, backend=self.backend
            )

    def _init_hybrid(
        self,
        hybrid_config: HybridConfig,
        source: ModelSource | StageWeights,
        ring_slots: int,
        mtp: bool,
    ) -> None:
        """Hand this stage to ``hybrid.HybridStage`` (NumPy only, weights from a source)."""
        if self.backend.name != "cpu":
            raise ModelConfigError(
                f"the CUDA stage does not run {self.config.model_type} (hybrid) models yet; "
                "use --device cpu"
            )
        if isinstance(source, StageWeights):
            raise ModelConfigError("a hybrid stage loads its weights from the model source")
        weights = load_hybrid_weights(
            source,
            hybrid_config,
            self.start,
            self.end,
            embed=self.embed,
            head=self.head,
            backend=self.backend,
        )
        self.weights = weights
        self.hybrid = HybridStage(
            hybrid_config,
            weights,
            self.start,
            self.end,
            embed=self.embed,
            head=self.head,
            backend=self.backend,
            linear=self._linear,
            ring_slots=ring_slots,
        )
        if mtp and self.head and has_mtp(source):
            self.mtp = MtpHead(self.hybrid, load_mtp_weights(source, self.backend))

    @property
    def cuda(self) -> CudaStage | None:
        """The device side of this stage on a CUDA backend (None on the CPU)."""
        return self._cuda

    def new_cache(self, max_tokens: int) -> KVCache:
        """An empty KV cache for one sequence of up to ``max_tokens`` positions.

        A hybrid stage's cache (``recurrent.HybridCache``) also holds the recurrent state
        and its snapshot ring; it offers the same ``length``/``truncate``/``nbytes``.
        """
        if self.hybrid is not None:
            return self.hybrid.new_cache(max_tokens)
        if self._cuda is not None:
            return self._cuda.new_cache(max_tokens)
        c = self.config
        return KVCache(self.xp, self.end - self.start, c.num_kv_heads, c.head_dim, max_tokens)

    def forward(
        self, inputs: Any, start_pos: int, cache: KVCache, *, out_rows: int | None = None
    ) -> Any:
        """Run the stage on S new positions starting at ``start_pos``.

        ``inputs`` are token ids ``[S]`` on the first stage, hidden states ``[S, E]``
        otherwise. The cache is first truncated to ``start_pos`` (rollback needs no
        message). Returns hidden states ``[S, E]``, or on the head stage the logits
        ``[r, V]`` of the last ``r = out_rows`` rows (all rows when None): the other rows
        only write their K/V in the last layer and skip the rest of it and the head.
        Raises ``ValueError`` if ``start_pos`` is past the cache's end or the cache is full.
        """
        if self._cuda is not None:
            return self._cuda.forward(inputs, start_pos, cache, out_rows)
        if self.hybrid is not None:
            assert isinstance(cache, HybridCache), "a hybrid stage runs on its own new_cache"
            return self.hybrid.forward(inputs, start_pos, cache, out_rows=out_rows)
        cache.truncate(start_pos)
        x = self._embed(inputs) if self.embed else self.xp.asarray(inputs, self.xp.float32)
        n = x.shape[0]
        rows = n if out_rows is None or not self.head else min(out_rows, n)
        ropes = [self._rope(f, start_pos, n) for f in self._freqs]  # [S, D] cos, sin
        last = len(self.weights.layers) - 1
        for i, layer in enumerate(self.weights.layers):
            keep = rows if i == last else n
            rope = ropes[self._rope_kind[i]]
            x = self._block(layer, x, start_pos, cache, i, rope, keep)
        if len(self.weights.layers) == 0:
            x = x[n - rows :]
        cache.length = start_pos + n
        return self._head(x) if self.head else x

    # -- pieces ------------------------------------------------------------------------

    def _block(
        self,
        w: LayerWeights,
        x: Any,
        pos: int,
        cache: KVCache,
        layer: int,
        rope: tuple[Any, Any],
        rows: int,
    ) -> Any:
        """One decoder block; only the last ``rows`` rows go past attention."""
        h = self._attention(w, self._rms_norm(x, w.attn_norm), pos, cache, layer, rope, rows)
        x = x[x.shape[0] - rows :] + self._maybe_norm(h, w.post_attn_norm)  # [r, E]
        return x + self._maybe_norm(self._mlp(w, self._rms_norm(x, w.ffn_norm)), w.post_ffn_norm)

    def _attention(
        self,
        w: LayerWeights,
        x: Any,
        pos: int,
        cache: KVCache,
        layer: int,
        rope: tuple[Any, Any],
        rows: int,
    ) -> Any:
        c, xp = self.config, self.xp
        cos, sin = rope  # [S, D]
        n = x.shape[0]
        qkv = self._linear(x, w.wqkv)  # [S, (H + 2 Hkv) D]
        if w.bqkv is not None:
            qkv = qkv + w.bqkv
        q = qkv[n - rows :, : c.q_size].reshape(rows, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].reshape(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
        q = self._maybe_norm(q, w.q_norm).transpose(1, 0, 2)  # QK-norm per head; [H, r, D]
        k = self._maybe_norm(k, w.k_norm).transpose(1, 0, 2)  # [Hkv, S, D]
        q = ops.rotate_half(xp, q, cos[n - rows :], sin[n - rows :])
        k = ops.rotate_half(xp, k, cos, sin)
        keys, values = cache.write(layer, pos, k, v.transpose(1, 0, 2))  # [Hkv, T, D]
        window = self._windows[layer]
        out = ops.attention(xp, q, keys, values, self._scale, window)  # [H, r, D]
        return self._linear(out.transpose(1, 0, 2).reshape(rows, c.q_size), w.wo)  # [r, E]

    def _mlp(self, w: LayerWeights, x: Any) -> Any:
        gate_up = self._linear(x, w.w_gate_up)  # [r, 2 I]
        if self.config.arch.activation == "gelu_tanh":
            return self._linear(ops.gelu_tanh_mul(self.xp, gate_up), w.w_down)  # GeGLU, [r, E]
        return self._linear(ops.silu_mul(self.xp, gate_up), w.w_down)  # SwiGLU, [r, E]

    def _linear(self, x: Any, w: Any) -> Any:
        """``x @ w`` for ``x`` ``[r, in]``, ``w`` ``[in, out]``; few rows go one by one."""
        n = x.shape[0]
        if 1 < n <= self.gemv_max_rows:
            return self.xp.stack([x[i] @ w for i in range(n)])
        return x @ w

    def _rms_norm(self, x: Any, weight: Any) -> Any:
        return ops.rms_norm(self.xp, x, weight, self.config.rms_norm_eps)

    def _maybe_norm(self, x: Any, weight: Any | None) -> Any:
        return x if weight is None else self._rms_norm(x, weight)

    def _rope(self, inv_freq: Any, start: int, n: int) -> tuple[Any, Any]:
        """cos and sin ``[S, D]`` for positions ``start .. start + n - 1``."""
        return ops.rope_cos_sin(self.xp, inv_freq, start, n)

    def _embed(self, ids: Any) -> Any:
        x = self._lookup(ids)  # [S, E]
        return x * self._embed_scale if self.config.arch.scaled_embeddings else x

    def _lookup(self, ids: Any) -> Any:
        assert self.weights.embed_t is not None
        idx = self.xp.asarray(ids, dtype=self.xp.int64)
        table = self.weights.embed_t
        if isinstance(table, BlockMatrix):  # GGUF blocks: decode the rows asked for
            return table.rows(idx)  # [S, E]
        return table[:, idx].T  # [S, E]

    def _head(self, x: Any) -> Any:
        w = self.weights
        assert w.norm is not None
        h = self._rms_norm(x, w.norm)
        table = w.head_t if w.head_t is not None else w.embed_t
        return self._linear(h, table)  # [r, V]
