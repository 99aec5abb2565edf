"""What a stage of a model costs in memory: the footprint the planner places layers by, and
the check a worker makes of a ``Load`` before it allocates anything.

Weights count as the backend holds them. KV: a CPU or CUDA stage of a model with K/V per
position keeps one pool of blocks, :func:`~meshnode.node.prefix.pool_blocks` (a few whole
contexts, whatever the sequence limit: the host admits requests by the blocks they may
write); a hybrid stage preallocates every live sequence's whole context (and a hybrid
model's recurrent state and snapshot ring), so it scales with the sequence limit
:data:`~meshnode.node.pipeline.MAX_SEQUENCES_PER_STAGE`; a hybrid stage also keeps
snapshots of cached prefixes, at most :data:`~meshnode.node.hybrid_prefix.SNAPSHOT_CONTEXTS`
whole contexts (and recurrent states) of them.
"""

from __future__ import annotations

from meshnode.engine.config import ModelConfig
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.kv_cache import KV_BLOCK, kv_bytes
from meshnode.engine.recurrent import DEFAULT_RING_SLOTS
from meshnode.engine.weights import HeldBytes
from meshnode.errors import ConfigError, RunError
from meshnode.node.hybrid_prefix import SNAPSHOT_CONTEXTS
from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.planner import ModelFootprint
from meshnode.node.prefix import pool_blocks
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
    KV (module docstring): a CPU or CUDA stage's pool of blocks, a hybrid one every live
    sequence's whole context; each key and value element takes 4 bytes, 2 with
    ``kv_dtype`` f16 (a hybrid model's attention layers keep float32).
    """
    if config.hybrid is not None:
        return _hybrid_footprint(config, config.hybrid, bytes_per_param, ring_slots)
    one = 2 * config.kv_size * kv_bytes(kv_dtype)  # K and V of a position of one layer
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
        kv_bytes_per_token_per_layer=one * MAX_SEQUENCES_PER_STAGE,
        tied_head=config.tie_word_embeddings,
        pool_tokens=_pool_tokens,
        pool_kv_bytes_per_token_per_layer=one,
    )


def _pool_tokens(context_size: int) -> int:
    """Positions of a stage's pool of KV blocks for ``context_size``."""
    return pool_blocks(context_size) * KV_BLOCK


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
    the recurrent state and snapshot ring of every live sequence, whatever the context;
    and the cached prefixes' snapshots (:data:`SNAPSHOT_CONTEXTS` contexts of both)."""
    layers = range(hybrid.num_layers)
    state = hybrid.recurrent_shape().nbytes()
    fixed = state * (1 + ring_slots) * MAX_SEQUENCES_PER_STAGE + state * SNAPSHOT_CONTEXTS
    contexts = MAX_SEQUENCES_PER_STAGE + SNAPSHOT_CONTEXTS
    # The last stage also holds the MTP module, which embeds the tokens it predicts: the
    # embedding comes with it when the head does not share it already.
    mtp = hybrid.mtp_params()
    if hybrid.mtp_layers and not config.tie_word_embeddings:
        mtp += config.embed_params
    return ModelFootprint(
        layer_bytes=tuple(config.layer_params(i) * bytes_per_param for i in layers),
        embed_bytes=config.embed_params * bytes_per_param,
        head_bytes=(config.head_params + mtp) * bytes_per_param,
        kv_bytes_per_token_per_layer=2 * config.kv_size * 4 * contexts,
        tied_head=config.tie_word_embeddings,
        kv_layers=tuple(not hybrid.is_linear(i) for i in layers),
        fixed_layer_bytes=tuple(fixed if hybrid.is_linear(i) else 0 for i in layers),
    )


def stage_kv_bytes(
    config: ModelConfig,
    start: int,
    end: int,
    context_size: int,
    kv_dtype: str = "f32",
) -> int:
    """The most KV a stage of layers ``[start, end)`` holds: its pool of blocks
    (:meth:`~meshnode.node.prefix.StagePrefix.for_stage`, on a CPU or CUDA node alike), or
    a hybrid model's every live sequence's context, as the planner counts it
    (:meth:`ModelFootprint.kv_bytes`). Pure, for the planner's per-stage check and a
    worker's ``Load`` check."""
    return model_footprint(config, kv_dtype=kv_dtype).kv_bytes(start, end, context_size, "cpu")


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
    alone (:func:`stage_kv_bytes`) would take more than the ``memory_bytes`` this node
    offers (another node chose the context), or whose KV dtype a stage does not keep (f32,
    f16). Returns the KV bytes it would take."""
    if kv_dtype not in ("f32", "f16"):
        raise RunError(f"Load asks for KV dtype {kv_dtype!r}; a stage keeps f32 or f16")
    limit = config.max_position_embeddings
    if not 1 <= context_size <= limit:
        raise RunError(
            f"Load asks for a context of {context_size} tokens; the model holds 1..{limit}"
        )
    kv = stage_kv_bytes(config, start, end, context_size, kv_dtype)
    if memory_bytes is not None and kv > memory_bytes:
        raise RunError(
            f"Load asks for a context of {context_size} tokens: its KV cache alone would take "
            f"{kv / 2**20:.0f} MiB, more than the {memory_bytes / 2**20:.0f} MiB this node offers"
        )
    return kv
