"""What a stage of a model costs in memory: the footprint the planner places layers by, and
the check a worker makes of a ``Load`` before it allocates anything.

Weights count as the backend holds them; every live sequence preallocates KV for the whole
context (and a hybrid model's recurrent state and snapshot ring), so both scale with the
sequence limit :data:`~meshnode.node.pipeline.MAX_SEQUENCES_PER_STAGE`.
"""

from __future__ import annotations

from meshnode.engine.config import ModelConfig
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.kv_cache import kv_bytes, kv_numpy_dtype
from meshnode.engine.kv_pages import block_bytes
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.engine.weights import HeldBytes
from meshnode.errors import ConfigError, RunError
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.planner import ModelFootprint
from meshnode.node.prefix import live_blocks, pool_bytes
from meshnode.node.stage import default_context


def model_footprint(
    config: ModelConfig,
    bytes_per_param: int = 4,
    held: HeldBytes | None = None,
    ring_slots: int = DEFAULT_RING_SLOTS,
    kv_dtype: str = "f32",
) -> ModelFootprint:
    """Bytes the planner must reserve per layer, for the embedding, the head and the KV.

    Weights: ``held`` when known (a CPU stage keeps the file's GGUF blocks, so a layer
    costs its tensors' bytes in the file; :meth:`~meshnode.engine.backend.Backend.held_bytes`),
    else every parameter at ``bytes_per_param`` (4: float32, the most any backend holds).
    Every live sequence preallocates KV for the whole context, so KV scales with the
    sequence limit; each key and value element takes 4 bytes, 2 with ``kv_dtype`` f16
    (a hybrid model's attention layers keep float32).
    """
    if config.hybrid is not None:
        return _hybrid_footprint(config, config.hybrid, bytes_per_param, ring_slots)
    kv_per_token = 2 * config.kv_size * kv_bytes(kv_dtype) * MAX_SEQUENCES_PER_STAGE  # K, V
    if held is None:
        held = HeldBytes(
            tuple(config.layer_params(i) * bytes_per_param for i in range(config.num_layers)),
            config.embed_params * bytes_per_param,
            config.head_params * bytes_per_param,
        )
    return ModelFootprint(
        layer_bytes=held.layers,
        embed_bytes=held.embed,
        head_bytes=held.head,
        kv_bytes_per_token_per_layer=kv_per_token,
        tied_head=config.tie_word_embeddings,
    )


def moe_status(config: ModelConfig) -> dict[str, int] | None:
    """A mixture-of-experts model's shape for the status body (None for a dense model):
    experts per MoE layer, how many a token runs, how many layers route, and parameters,
    all and those a token runs (embedding and head counted whole in both, as model cards
    count Qwen3-30B-A3B's 3.3B active)."""
    moe = config.moe or (config.hybrid.moe if config.hybrid is not None else None)
    if moe is None:
        return None
    h = config.hidden_size
    outer = config.embed_params + config.head_params  # embedding, final norm, head
    total = outer + sum(config.layer_params(i) for i in range(config.num_layers))
    every, active = moe.layer_params(h)
    moe_layers = sum(moe.sparse_layers)
    return {
        "experts_per_layer": moe.num_experts,
        "experts_per_token": moe.top_k,
        "moe_layers": moe_layers,
        "layers": config.num_layers,
        "params": total,
        "active_params": total - (every - active) * moe_layers,  # the idle experts left out
    }


def _hybrid_footprint(
    config: ModelConfig, hybrid: HybridConfig, bytes_per_param: int, ring_slots: int
) -> ModelFootprint:
    """A hybrid model's footprint: KV on the attention layers only; on each DeltaNet layer
    the recurrent state and snapshot ring of every live sequence, whatever the context."""
    layers = range(hybrid.num_layers)
    per_sequence = hybrid.recurrent_shape().nbytes() * (1 + ring_slots)
    return ModelFootprint(
        layer_bytes=tuple(config.layer_params(i) * bytes_per_param for i in layers),
        embed_bytes=config.embed_params * bytes_per_param,
        head_bytes=config.head_params * bytes_per_param,
        kv_bytes_per_token_per_layer=2 * config.kv_size * 4 * MAX_SEQUENCES_PER_STAGE,
        tied_head=config.tie_word_embeddings,
        kv_layers=tuple(not hybrid.is_linear(i) for i in layers),
        fixed_layer_bytes=tuple(
            per_sequence * MAX_SEQUENCES_PER_STAGE if hybrid.is_linear(i) else 0 for i in layers
        ),
    )


def stage_kv_bytes(
    config: ModelConfig,
    start: int,
    end: int,
    context_size: int,
    kv_dtype: str = "f32",
    *,
    prefix_pool: bool = True,
) -> int:
    """The most KV a stage of layers ``[start, end)`` holds. A CPU stage of a model with
    K/V per position (``prefix_pool``) keeps one pool of blocks
    (:meth:`~meshnode.node.prefix.StagePrefix.for_stage`): every live sequence's whole
    context (:data:`~meshnode.node.pipeline.MAX_SEQUENCES_PER_STAGE` of them) and a block
    for a copy-on-write (:func:`~meshnode.node.prefix.live_blocks`), plus the cached
    prefixes' budget (:func:`~meshnode.node.prefix.pool_bytes`), in whole blocks. A hybrid
    model's stage, or one with ``prefix_pool`` False (CUDA), preallocates each live
    sequence's context (:meth:`ModelFootprint.kv_bytes`). Pure, for the planner's
    per-stage check."""
    live = model_footprint(config, kv_dtype=kv_dtype).kv_bytes(start, end, context_size)
    if not prefix_pool or config.hybrid is not None:
        return live
    dtype = kv_numpy_dtype(kv_dtype)
    per_block = block_bytes(end - start, config.num_kv_heads, config.head_dim, dtype)
    cached = pool_bytes(config, end - start, context_size, kv_dtype) // per_block
    return (live_blocks(context_size) + cached) * per_block


def served_context(config: ModelConfig, asked: int | None) -> int:
    """The context a host serves: ``asked`` (``--context``), else the model's default.
    Raises ``ConfigError`` for more than the model's positions."""
    context = asked or default_context(config)
    if context > config.max_position_embeddings:
        raise ConfigError(
            f"--context {context} is more than the model holds "
            f"({config.max_position_embeddings} tokens)"
        )
    return context


def check_load(
    config: ModelConfig,
    start: int,
    end: int,
    context_size: int,
    memory_bytes: int | None,
    kv_dtype: str = "f32",
) -> int:
    """Refuse (``RunError``) a ``Load`` whose context the model cannot hold, whose KV
    alone would take more than the ``memory_bytes`` this node offers (another node chose
    the context, and every sequence preallocates it), or whose KV dtype a stage does not
    keep (f32, f16). Returns the KV bytes it would take."""
    if kv_dtype not in ("f32", "f16"):
        raise RunError(f"Load asks for KV dtype {kv_dtype!r}; a stage keeps f32 or f16")
    limit = config.max_position_embeddings
    if not 1 <= context_size <= limit:
        raise RunError(
            f"Load asks for a context of {context_size} tokens; the model holds 1..{limit}"
        )
    kv = model_footprint(config, kv_dtype=kv_dtype).kv_bytes(start, end, context_size)
    if memory_bytes is not None and kv > memory_bytes:
        raise RunError(
            f"Load asks for a context of {context_size} tokens: its KV cache alone would take "
            f"{kv / 2**20:.0f} MiB, more than the {memory_bytes / 2**20:.0f} MiB this node offers"
        )
    return kv
