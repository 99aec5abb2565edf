"""The decoder as a pipeline stage: layers ``[start, end)`` of one model.

One block serves every family in ``config.ARCHITECTURES``: Llama's pre-norm block, plus
what the model's row switches on (QK-norm, norms on the attention and MLP outputs,
GeGLU, scaled embeddings, sliding-window layers with their own RoPE base). A stage embeds
token ids when it is the first stage and applies the final norm and the output head when
it is the last. One ``forward`` handles prefill (many new tokens), decode
(one) and verify (k + 1) alike: new tokens attend causally to the cache and to each other.
The backend (``meshnode.engine.backend``) loads the weights and does the matrix products;
on a CUDA backend it gives the stage a device side that takes the whole forward
(``meshnode.engine.cuda.stage``: the same math as the functions of ``meshnode.engine.ops``
this file calls, as fused kernels).

Shapes: S new tokens, T cached + new positions, E hidden size, H query heads, Hkv key/value
heads, G = H / Hkv, D head dim, V vocabulary, r rows whose output is wanted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from meshnode_packaging.sources import ModelSource

from meshnode.engine.attention import Segment
from meshnode.engine.backend import Backend, cpu_backend
from meshnode.engine.config import ModelConfig, ModelConfigError
from meshnode.engine.cuda.stage import CudaStage
from meshnode.engine.hybrid import HybridStage, load_hybrid_weights
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.kv_cache import KVCache, kv_numpy_dtype, resolve_kv_dtype
from meshnode.engine.mtp import MtpHead, has_mtp, load_mtp_weights
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS, HybridCache
from meshnode.engine.weights import LayerWeights, StageWeights

__all__ = ["BatchRow", "HostArray", "Stage", "token_ids"]

#: Hidden states ``[S, E]`` or logits ``[r, V]`` copied to the host (``Backend.to_numpy``),
#: as a stage hands them to the next stage or to the sampler.
HostArray = npt.NDArray[np.float32]


def token_ids(tokens: Sequence[int]) -> npt.NDArray[np.int64]:
    """Token ids as a first stage's ``inputs`` ``[S]``."""
    return np.asarray(tokens, dtype=np.int64)


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
        kv_dtype: str = "auto",
    ) -> None:
        if not 0 <= start <= end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside 0..{config.num_layers}")
        self.config = config
        self.start, self.end = start, end
        self.embed, self.head = embed, head
        self.backend = backend or cpu_backend()
        self.backend.check_model(config)
        self.xp = self.backend.xp
        # K/V of a CPU stage's caches (kv_cache.KV_DTYPES; auto: f16 with q8 weights, else
        # f32); a hybrid or CUDA stage keeps its own (float32; the device's)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.backend.weights_dtype)
        if config.hybrid is not None or self.backend.name != "cpu":
            self.kv_dtype = "f32"
        self._cuda: CudaStage | None = None
        self.hybrid: HybridStage | None = None
        self.mtp: MtpHead | None = None  # the model's MTP drafter (hybrid head stage)
        if config.hybrid is not None:  # Gated DeltaNet + gated attention layers
            self._init_hybrid(config.hybrid, source_or_weights, ring_slots, mtp)
            return
        if isinstance(source_or_weights, StageWeights):
            self.weights = source_or_weights
        else:
            self.weights = self.backend.load_weights(
                source_or_weights, config, start, end, embed=embed, head=head
            )
        # Gemma scales embeddings by sqrt(hidden) rounded to the activations' dtype first.
        self._embed_scale = np.float32(np.sqrt(config.hidden_size))
        # CUDA: the engine's kernels, fixed buffers, CUDA graphs take the forward
        self._cuda = self.backend.device_stage(config, self.weights, embed=embed, head=head)
        if self._cuda is None:
            # attention, RoPE and the KV cache of each sequence, as the backend computes them
            self._attention_of = self.backend.attention(config, start, end)

    def _init_hybrid(
        self,
        hybrid_config: HybridConfig,
        source: ModelSource | StageWeights,
        ring_slots: int,
        mtp: bool,
    ) -> None:
        """Hand this stage to ``hybrid.HybridStage`` (NumPy only, weights from a source;
        ``Backend.check_model`` refused it on any other backend)."""
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
            linear=self.backend.linear,
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
        and its snapshot ring; it offers the same ``length``/``truncate``/``nbytes``. A CPU
        stage's K/V are :attr:`kv_dtype`.
        """
        if self.hybrid is not None:
            return self.hybrid.new_cache(max_tokens)
        if self._cuda is not None:
            return self._cuda.new_cache(max_tokens)
        c, dtype = self.config, kv_numpy_dtype(self.kv_dtype)
        layers = self.end - self.start
        return KVCache(self.xp, layers, c.num_kv_heads, c.head_dim, max_tokens, dtype=dtype)

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
        return self.forward_batch([BatchRow(inputs, start_pos, cache, out_rows)])[0]

    def forward_batch(self, items: Sequence[BatchRow]) -> list[Any]:
        """Run several sequences' new positions as one forward; one output per item, as
        :meth:`forward` returns it.

        Every product with a weight matrix runs once over the rows of all items (one read
        of the weights for the whole batch); attention, RoPE and the KV cache stay per
        sequence (for a hybrid model, the recurrence too: ``HybridStage.forward_batch``).
        Items must name distinct caches. On CUDA the device stage batches the same way
        (``CudaStage.forward_batch``; a prompt chunk of more than ``MAX_ROWS`` rows runs
        alone). Raises ``ValueError`` as :meth:`forward` does.
        """
        if self.hybrid is not None:
            assert all(isinstance(i.cache, HybridCache) for i in items), "hybrid caches only"
            return self.hybrid.forward_batch(items)
        if self._cuda is not None:
            return self._cuda.forward_batch(items)
        segs = [self._segment(item) for item in items]
        x = _concat(self.xp, [self._inputs(item) for item in items])  # [N, E]
        layers = self.weights.layers
        last = len(layers) - 1
        plan = self._attention_of.prepare(segs) if last >= 0 else None
        # each block's output comes with its norm for the next one (residual add and norm
        # in one call): the next layer's attention norm, after the last the head's
        normed = self._rms_norm(x, layers[0].attn_norm) if layers else None
        head_norm = self.weights.norm if self.head else None
        for i, layer in enumerate(layers):
            then = layers[i + 1].attn_norm if i < last else head_norm
            x, normed = self._block(layer, x, normed, segs, plan, i, then)
        if not layers:
            x = x[_kept_rows(self.xp, segs)]
        for item, seg in zip(items, segs, strict=True):
            item.cache.length = seg.start_pos + seg.n
        out = self._head(x, normed, [seg.rows for seg in segs]) if self.head else x
        return _split(out, [seg.rows for seg in segs])

    def _segment(self, item: BatchRow) -> Segment:
        item.cache.truncate(item.start_pos)
        n = len(item.inputs)
        out_rows = item.out_rows
        rows = n if out_rows is None or not self.head else min(out_rows, n)
        return Segment(item.start_pos, n, rows, item.cache)

    def _inputs(self, item: BatchRow) -> Any:
        if self.embed:
            return self._embed(item.inputs)  # [S, E]
        return self.xp.asarray(item.inputs, self.xp.float32)  # [S, E]

    # -- pieces ------------------------------------------------------------------------

    def _block(
        self,
        w: LayerWeights,
        x: Any,
        normed: Any,
        segs: list[Segment],
        plan: Any,
        layer: int,
        then: Any | None,
    ) -> tuple[Any, Any]:
        """One decoder block over the rows of every segment (``normed``: ``x`` through
        its ``attn_norm``); in the stage's last layer only each segment's last ``rows``
        rows go past attention. Returns the block's output and it through the norm
        ``then`` (None when there is none)."""
        last = layer == len(self.weights.layers) - 1
        h = self._attention(w, normed, segs, plan, layer, last)
        if last:
            x = x[_kept_rows(self.xp, segs)]
        x, normed = self._add_norm(x, h, w.post_attn_norm, w.ffn_norm)  # [R, E]
        sizes = [seg.rows if last else seg.n for seg in segs]
        return self._add_norm(x, self._mlp(w, normed, sizes), w.post_ffn_norm, then)

    def _add_norm(
        self, x: Any, h: Any, h_norm: Any | None, then: Any | None
    ) -> tuple[Any, Any | None]:
        """The residual add ``x + h`` (``h`` through ``h_norm`` first, if any) and the sum
        through the norm ``then`` (None: not normed)."""
        return self.backend.add_rms_norm(x, h, h_norm, then, self.config.rms_norm_eps)

    def _attention(
        self, w: LayerWeights, x: Any, segs: list[Segment], plan: Any, layer: int, last: bool
    ) -> Any:
        qkv = self._linear(x, w.wqkv, [seg.n for seg in segs])  # [N, (H + 2 Hkv) D]: all rows
        if w.bqkv is not None:
            qkv = qkv + w.bqkv
        # per sequence: QK-norm, RoPE, its cache, attention (engine.attention)
        heads = self._attention_of(qkv, segs, plan, layer, (w.q_norm, w.k_norm), last)
        return self._linear(heads, w.wo, [seg.rows if last else seg.n for seg in segs])  # [R, E]

    def _mlp(self, w: LayerWeights, x: Any, sizes: list[int]) -> Any:
        gate_up = self._linear(x, w.w_gate_up, sizes)  # [r, 2 I]
        act = self.backend.glu(gate_up, self.config.arch.activation)  # SwiGLU/GeGLU, [r, I]
        return self._linear(act, w.w_down, sizes)  # [r, E]

    def _linear(self, x: Any, w: Any, sizes: list[int] | None = None) -> Any:
        """``x @ w`` for ``x`` ``[r, in]``, ``w`` ``[in, out]``, as the backend multiplies
        (``sizes``: the row counts of the batch's segments in ``x``)."""
        return self.backend.linear(x, w, sizes)

    def _rms_norm(self, x: Any, weight: Any) -> Any:
        return self.backend.rms_norm(x, weight, self.config.rms_norm_eps)

    def _embed(self, ids: Any) -> Any:
        x = self._lookup(ids)  # [S, E]
        return x * self._embed_scale if self.config.arch.scaled_embeddings else x

    def _lookup(self, ids: Any) -> Any:
        assert self.weights.embed_t is not None
        idx = self.xp.asarray(ids, dtype=self.xp.int64)
        return self.backend.embed_rows(self.weights.embed_t, idx)  # [S, E]

    def _head(self, x: Any, normed: Any | None = None, sizes: list[int] | None = None) -> Any:
        """Logits ``[r, V]`` of the rows ``x`` (``normed``: through the final norm already;
        ``sizes``: the row counts of the batch's segments in it)."""
        w = self.weights
        assert w.norm is not None
        h = self._rms_norm(x, w.norm) if normed is None else normed
        table = w.head_t if w.head_t is not None else w.embed_t
        return self._linear(h, table, sizes)  # [r, V]


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One sequence's part of a batched forward (the arguments of ``Stage.forward``)."""

    inputs: Any  # token ids [S] (first stage) or hidden states [S, E]
    start_pos: int
    cache: Any
    out_rows: int | None = None


def _concat(xp: Any, parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)


def _kept_rows(xp: Any, segs: list[Segment]) -> Any:
    """Indices of each segment's last ``rows`` rows in the stacked ``[N, E]`` activations."""
    ends = np.cumsum([seg.n for seg in segs])
    if len(segs) == 1:
        return slice(segs[0].n - segs[0].rows, segs[0].n)
    return xp.asarray(
        np.concatenate([np.arange(e - s.rows, e) for e, s in zip(ends, segs, strict=True)])
    )


def _split(out: Any, rows: list[int]) -> list[Any]:
    """The stacked output cut back into one array per segment."""
    if len(rows) == 1:
        return [out]
    bounds = np.cumsum(rows)[:-1]
    return [out[a:b] for a, b in zip([0, *bounds], [*bounds, sum(rows)], strict=True)]
