"""The decoder as a pipeline stage: layers ``[start, end)`` of one model.

One block serves every family in ``config.ARCHITECTURES`` and every backend: a block is a
norm, the layer's token mixer, a residual add, a norm, the layer's feed-forward and a
residual add, with what the model's row switches on (QK-norm, norms on the attention and
MLP outputs, GeGLU, scaled embeddings, sliding-window layers with their own RoPE base;
attention sinks and the output bias of gpt-oss).
What varies per layer is data: the token mixer is attention (``engine.attention`` on the
CPU, ``engine.cuda.attention`` on a device) or, in a hybrid model, a Gated DeltaNet or
gated-attention layer (``engine.hybrid``); the feed-forward is a dense gated MLP or, where
the model's ``moe`` config says a layer routes, a mixture of experts (``engine.moe``):
:func:`feed_forward_of` chooses by the layer's weights. Every
array operation goes through the :class:`~meshnode.engine.backend.Backend`, which also
runs the forward (on CUDA: fixed buffers and a CUDA graph capturing this same block).
A stage embeds token ids when it is the first stage and applies the final norm and the
output head when it is the last. One ``forward`` handles prefill (many new tokens),
decode (one) and verify (k + 1) alike: new tokens attend causally to the cache and to each
other.

Shapes: S new tokens, N new rows of a batch, R rows kept past the last layer's mixer,
T cached + new positions, E hidden size, H query heads, Hkv key/value heads, D head dim,
V vocabulary, r rows whose output is wanted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from meshnode_packaging.sources import ModelSource

from meshnode.engine.attention import Attention, KernelAttention, Segment
from meshnode.engine.backend import Backend, cpu_backend
from meshnode.engine.config import ModelConfig, ModelConfigError
from meshnode.engine.hybrid import HybridMixer, load_hybrid_weights
from meshnode.engine.kv_cache import KVCache, kv_numpy_dtype, resolve_kv_dtype
from meshnode.engine.moe import moe_mlp
from meshnode.engine.moe_config import MoeConfig
from meshnode.engine.mtp import MtpHead, has_mtp, load_mtp_weights
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.engine.weights import LayerWeights, StageWeights

__all__ = ["BatchRow", "HostArray", "Stage", "feed_forward_of", "token_ids"]

#: Hidden states ``[S, E]`` or logits ``[r, V]`` copied to the host (``Backend.to_numpy``),
#: as a stage hands them to the next stage or to the sampler.
HostArray = npt.NDArray[np.float32]


def token_ids(tokens: Sequence[int]) -> npt.NDArray[np.int64]:
    """Token ids as a first stage's ``inputs`` ``[S]``."""
    return np.asarray(tokens, dtype=np.int64)


class Block(Protocol):
    """What the block reads of a layer's weights whatever its kinds (``weights.LayerWeights``,
    ``hybrid_weights.HybridLayerWeights``): its norms (None: not applied)."""

    @property
    def attn_norm(self) -> Any: ...  # [E], before the token mixer
    @property
    def post_attn_norm(self) -> Any | None: ...  # [E], on the mixer's output (Gemma 3)
    @property
    def ffn_norm(self) -> Any: ...  # [E], before the feed-forward
    @property
    def post_ffn_norm(self) -> Any | None: ...  # [E], on the feed-forward's output


class Mixer(Protocol):
    """A stage's token mixers: ``prepare`` once per forward (the plan), then a call per
    layer; ``keep_rows`` cuts ``[N, E]`` to each segment's last ``rows`` rows ``[R, E]``."""

    def prepare(self, segs: Sequence[Segment]) -> Any: ...
    def keep_rows(self, x: Any, segs: Sequence[Segment], plan: Any) -> Any: ...
    def __call__(
        self, w: Any, x: Any, segs: Sequence[Segment], plan: Any, layer: int, last: bool
    ) -> Any: ...


#: A layer's feed-forward: ``(backend, weights, x [r, E], activation, sizes) -> [r, E]``,
#: ``sizes`` the row counts of the batch's segments in ``x`` (``Backend.linear``).
FeedForward = Callable[[Backend, Any, Any, str, Sequence[int]], Any]


def glu_feed_forward(
    backend: Backend, w: Any, x: Any, activation: str, sizes: Sequence[int]
) -> Any:
    """The dense gated MLP (SwiGLU / GeGLU) of ``x`` ``[r, E]``."""
    gate_up = backend.linear(x, w.w_gate_up, sizes)  # [r, 2 I]
    act = backend.glu(gate_up, activation)  # [r, I]
    return backend.linear(act, w.w_down, sizes)  # [r, E]


def feed_forward_of(w: Any, moe: MoeConfig | None) -> FeedForward:
    """The feed-forward kind of a layer, chosen by its weights: routed experts
    (``engine.moe``, by the model's ``moe`` config) where they hold a router and experts
    (``w.moe``), else the dense gated MLP."""
    if getattr(w, "moe", None) is None:
        return glu_feed_forward
    if moe is None:
        raise ModelConfigError("a layer holds experts but the model's config has none")
    routing = moe

    def routed(backend: Backend, w: Any, x: Any, activation: str, sizes: Sequence[int]) -> Any:
        # each row's experts and sums are its own (engine.moe): the same bits in any batch
        return moe_mlp(backend, routing, w.moe, x, sizes)  # [r, E]

    return routed


class _AttentionMixer:
    """The token mixer of a plain decoder: the fused q/k/v projection (and bias), the
    backend's attention over each sequence's cache, the output projection."""

    def __init__(self, backend: Backend, attention: Attention) -> None:
        self.backend, self.attention = backend, attention

    def prepare(self, segs: Sequence[Segment]) -> Any:
        return self.attention.prepare(segs)

    def keep_rows(self, x: Any, segs: Sequence[Segment], plan: Any) -> Any:
        return self.attention.keep_rows(x, segs, plan)

    def __call__(
        self, w: LayerWeights, x: Any, segs: Sequence[Segment], plan: Any, layer: int, last: bool
    ) -> Any:
        # each segment's rows by the path they take alone (Backend.linear's sizes)
        qkv = self.backend.linear(x, w.wqkv, [seg.n for seg in segs])  # [N, (H + 2 Hkv) D]
        if w.bqkv is not None:
            qkv = self.backend.add(qkv, w.bqkv)
        # per sequence: QK-norm, RoPE, its cache, attention
        norms = (w.q_norm, w.k_norm)
        heads = self.attention(qkv, segs, plan, layer, norms, last, w.sinks)  # [R, H D]
        out = self.backend.linear(heads, w.wo, [seg.rows if last else seg.n for seg in segs])
        return out if w.bo is None else self.backend.add(out, w.bo)  # gpt-oss: output bias


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
        # K/V of the caches (kv_cache.KV_DTYPES; auto: f16 with q8 weights, else f32); a
        # hybrid stage keeps float32, a CUDA one the device's (Backend.new_kv_cache)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.backend.weights_dtype)
        if config.hybrid is not None:
            self.kv_dtype = "f32"
        self.mtp: MtpHead | None = None  # the model's MTP drafter (hybrid head stage)
        # Head stage with an MTP drafter: every row's final-normed hidden state of the last
        # forward (keep_hidden)
        self._keep_hidden = False
        self._last_hidden: Any = None  # [R, E]
        # Called with each layer's index + 1 before the layer computes: the read-ahead of a
        # stage served from disk (engine.readahead); None: its weights are in memory.
        self.read_ahead: Callable[[int], object] | None = None
        # Gemma scales embeddings by sqrt(hidden) rounded to the activations' dtype first.
        self._embed_scale = np.float32(np.sqrt(config.hidden_size))
        self._hybrid: HybridMixer | None = None
        self._mixer: Mixer
        if config.hybrid is not None:  # Gated DeltaNet + gated attention layers
            if isinstance(source_or_weights, StageWeights):
                raise ModelConfigError("a hybrid stage loads its weights from the model source")
            source = source_or_weights
            weights = load_hybrid_weights(
                source, config.hybrid, start, end, embed=embed, head=head, backend=self.backend
            )
            self.weights: StageWeights = weights
            self.layers: Sequence[Block] = weights.blocks
            hybrid = HybridMixer(
                config.hybrid, weights, start, end, head=head, backend=self.backend,
                ring_slots=ring_slots,
            )  # fmt: skip
            self._hybrid, self._mixer = hybrid, hybrid
            if mtp and head and has_mtp(source):
                mtp_weights = load_mtp_weights(source, self.backend, config.hybrid.moe)
                self.mtp = MtpHead(hybrid, mtp_weights)
        else:
            if isinstance(source_or_weights, StageWeights):
                self.weights = source_or_weights
            else:
                self.weights = self.backend.load_weights(
                    source_or_weights, config, start, end, embed=embed, head=head
                )
            self.layers = self.weights.layers
            attention = self.backend.attention(config, start, end)
            if isinstance(attention, KernelAttention):  # its kernel compiles meanwhile
                attention.compile_ahead(self.layers, kv_numpy_dtype(self.kv_dtype))
            self._mixer = _AttentionMixer(self.backend, attention)
        moe = config.hybrid.moe if config.hybrid is not None else config.moe
        self._feed_forward = [feed_forward_of(w, moe) for w in self.layers]
        # each layer's feed-forward half of a one-row step in one call, where the backend
        # has one for it (Backend.moe_step; None: the Python path below)
        eps = config.rms_norm_eps
        self._steps = [
            None if self._hybrid is not None else self.backend.moe_step(w, moe, eps)
            for w in self.layers
        ]
        # The backend runs the forward: on CUDA it replays decode steps as CUDA graphs.
        self._runner = self.backend.runner(config, embed=embed, graphs=self._hybrid is None)

    def new_cache(self, max_tokens: int) -> KVCache:
        """An empty KV cache for one sequence of up to ``max_tokens`` positions.

        A hybrid stage's cache (``recurrent.HybridCache``) also holds the recurrent state
        and its snapshot ring; it offers the same ``length``/``truncate``/``nbytes``. A CPU
        stage's K/V are :attr:`kv_dtype`.
        """
        if self._hybrid is not None:
            return self._hybrid.new_cache(max_tokens)
        c = self.config
        shape = (self.end - self.start, c.num_kv_heads, c.head_dim)
        return self.backend.new_kv_cache(shape, max_tokens, self.kv_dtype, self.weights)

    def replay_seconds(self, rows: int, repeats: int) -> float | None:
        """Device seconds of one replay of the CUDA graph of a ``rows``-row decode step,
        timed over ``repeats`` replays (None: none captured, or the CPU). For benchmarks."""
        return self._runner.replay_seconds(rows, repeats)

    def keep_hidden(self, keep: bool) -> None:
        """Whether the next forwards keep every row's final-normed hidden state in
        :attr:`last_hidden` (the MTP drafter reads every committed row; a head stage,
        meant for a batch of one)."""
        self._keep_hidden = keep and self.head

    @property
    def last_hidden(self) -> Any:
        """The final-normed hidden rows ``[R, E]`` of the last forward of a head stage
        (every row while :meth:`keep_hidden` is on, else the rows the head read)."""
        return self._last_hidden

    def forward(
        self, inputs: Any, start_pos: int, cache: KVCache, *, out_rows: int | None = None
    ) -> Any:
        """Run the stage on S new positions starting at ``start_pos``.

        ``inputs`` are token ids ``[S]`` on the first stage, hidden states ``[S, E]``
        otherwise. The cache is first truncated to ``start_pos`` (rollback needs no
        message; a hybrid cache restores its recurrent state from the snapshot ring).
        Returns hidden states ``[S, E]``, or on the head stage the logits ``[r, V]`` of
        the last ``r = out_rows`` rows (all rows when None): the other rows only write
        their K/V in the last layer and skip the rest of it and the head. Raises
        ``ValueError`` if ``start_pos`` is past the cache's end or the cache is full
        (``RollbackError`` when it is behind a hybrid cache's ring).
        """
        return self.forward_batch([BatchRow(inputs, start_pos, cache, out_rows)])[0]

    def forward_batch(self, items: Sequence[BatchRow]) -> list[Any]:
        """Run several sequences' new positions as one forward; one output per item, as
        :meth:`forward` returns it.

        Every product with a weight matrix runs once over the rows of all items (one read
        of the weights for the whole batch); attention, RoPE, the KV cache and a hybrid
        model's recurrence stay per sequence. Items must name distinct caches. The backend
        may cut a batch into several forwards (CUDA: a long prompt runs alone, at most
        ``MAX_BATCH_ROWS`` rows together). Raises ``ValueError`` as :meth:`forward` does.
        """
        if len({id(item.cache) for item in items}) != len(items):
            raise ValueError("a batch names each sequence's cache once")
        for item in items:  # refused before any cache is rolled back
            if (end := item.start_pos + len(item.inputs)) > item.cache.max_tokens:
                raise ValueError(f"KV cache full: {end} > {item.cache.max_tokens} tokens")
        outs: list[Any] = [None] * len(items)
        for group in self._runner.groups([len(item.inputs) for item in items]):
            run = [items[i] for i in group]
            for i, out in zip(group, self._forward_group(run), strict=True):
                outs[i] = out
        return outs

    def _forward_group(self, items: Sequence[BatchRow]) -> list[Any]:
        segs = [self._segment(item) for item in items]
        wanted = [self._wanted(item) for item in items]
        key = (sum(seg.n for seg in segs), sum(seg.rows for seg in segs), sum(wanted))
        out = self._runner.run(
            key,
            [item.inputs for item in items],
            lambda: self._mixer.prepare(segs),
            lambda x, plan: self._layers_and_head(x, segs, plan, wanted),
        )
        for seg in segs:
            seg.cache.advance(seg.start_pos, seg.n)
        return _split(out, wanted if self.head else [seg.rows for seg in segs])

    def _layers_and_head(
        self, inputs: Any, segs: list[Segment], plan: Any, wanted: list[int]
    ) -> Any:
        """The forward proper, over the stacked inputs (ids ``[N]`` or hidden ``[N, E]``,
        on the device): every launch a CUDA graph captures. Returns ``[R, E]``, or on the
        head stage the logits ``[r, V]`` of the wanted rows."""
        x = self._embed(inputs) if self.embed else inputs  # [N, E]
        layers, last = self.layers, len(self.layers) - 1
        # each block's output comes with its norm for the next one (residual add and norm
        # in one call): the next layer's attention norm, after the last the head's
        normed = self._rms_norm(x, layers[0].attn_norm) if layers else None
        head_norm = self.weights.norm if self.head else None
        for i, layer in enumerate(layers):
            if self.read_ahead is not None:
                self.read_ahead(i + 1)
            then = layers[i + 1].attn_norm if i < last else head_norm
            x, normed = self._block(layer, x, normed, segs, plan, i, then)
        if not layers:
            x = self._mixer.keep_rows(x, segs, plan)  # [R, E]
        return self._head(x, normed, segs, wanted) if self.head else x

    def _segment(self, item: BatchRow) -> Segment:
        item.cache.truncate(item.start_pos)
        n = len(item.inputs)
        item.cache.reserve(item.start_pos + n)  # a paged cache takes its blocks here
        rows = n if self._keep_hidden else self._wanted(item)
        return Segment(item.start_pos, n, rows, item.cache)

    def _wanted(self, item: BatchRow) -> int:
        """Rows of ``item`` whose output is returned (``out_rows`` on the head stage)."""
        n = len(item.inputs)
        return n if item.out_rows is None or not self.head else min(item.out_rows, n)

    # -- pieces ------------------------------------------------------------------------

    def _block(
        self,
        w: Block,
        x: Any,
        normed: Any,
        segs: list[Segment],
        plan: Any,
        layer: int,
        then: Any | None,
    ) -> tuple[Any, Any]:
        """One decoder block over the rows of every segment (``normed``: ``x`` through
        its ``attn_norm``); in the stage's last layer only each segment's last ``rows``
        rows go past the token mixer. Returns the block's output and it through the norm
        ``then`` (None when there is none)."""
        last = layer == len(self.layers) - 1
        h = self._mixer(w, normed, segs, plan, layer, last)  # [R, E]
        if last:
            x = self._mixer.keep_rows(x, segs, plan)  # [R, E]
        step = self._steps[layer]
        if step is not None and (done := step(x, h, then)) is not None:
            return done  # one row's feed-forward half in one call (Backend.moe_step)
        x, normed = self._add_norm(x, h, w.post_attn_norm, w.ffn_norm)
        sizes = [seg.rows if last else seg.n for seg in segs]  # each segment's rows
        ffn = self._feed_forward[layer](self.backend, w, normed, self.config.arch.activation, sizes)
        return self._add_norm(x, ffn, w.post_ffn_norm, then)

    def _add_norm(
        self, x: Any, h: Any, h_norm: Any | None, then: Any | None
    ) -> tuple[Any, Any | None]:
        """The residual add ``x + h`` (``h`` through ``h_norm`` first, if any) and the sum
        through the norm ``then`` (None: not normed)."""
        return self.backend.add_rms_norm(x, h, h_norm, then, self.config.rms_norm_eps)

    def _rms_norm(self, x: Any, weight: Any) -> Any:
        return self.backend.rms_norm(x, weight, self.config.rms_norm_eps)

    def _embed(self, ids: Any) -> Any:
        assert self.weights.embed_t is not None
        x = self.backend.embed_rows(self.weights.embed_t, ids)  # [S, E]
        return self.backend.scale(x, self._embed_scale) if self.config.arch.scaled_embeddings else x

    def _head(self, x: Any, normed: Any | None, segs: list[Segment], wanted: list[int]) -> Any:
        """Logits ``[r, V]`` of each segment's last ``wanted`` rows of ``x`` ``[R, E]``
        (``normed``: through the final norm already)."""
        w = self.weights
        assert w.norm is not None
        h = self._rms_norm(x, w.norm) if normed is None else normed
        self._last_hidden = h
        if self._keep_hidden:
            h = _last_rows(self.xp, h, [seg.rows for seg in segs], wanted)
        table = w.head_t if w.head_t is not None else w.embed_t
        # each segment's rows by the path they take alone (Backend.linear's sizes)
        sizes = wanted if self._keep_hidden else [seg.rows for seg in segs]
        return self.backend.linear(h, table, sizes)  # [r, V]


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One sequence's part of a batched forward (the arguments of ``Stage.forward``)."""

    inputs: Any  # token ids [S] (first stage) or hidden states [S, E]
    start_pos: int
    cache: Any
    out_rows: int | None = None


def _last_rows(xp: Any, x: Any, sizes: list[int], last: list[int]) -> Any:
    """The last ``last[i]`` of each run of ``sizes[i]`` rows of ``x``."""
    if sizes == last:
        return x
    ends = np.cumsum(sizes)
    parts = [x[e - k : e] for e, k in zip(ends, last, strict=True)]
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)


def _split(out: Any, rows: list[int]) -> list[Any]:
    """The stacked output cut back into one array per segment."""
    if len(rows) == 1:
        return [out]
    bounds = np.cumsum(rows)[:-1]
    return [out[a:b] for a, b in zip([0, *bounds], [*bounds, sum(rows)], strict=True)]
