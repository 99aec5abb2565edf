"""The planner: which node runs which contiguous range of layers. A pure function.

Theory of operation. A model is a chain of ``n_layers`` blocks plus the embedding (needed by
the first stage) and the head (needed by the last; when the head is tied to the embedding the
last stage holds the embedding too). A stage running layers ``[start, end)`` needs

    sum(layer_bytes[start:end]) + (end - start) * kv_bytes_per_token_per_layer * context
    + sum(fixed_layer_bytes[start:end]) + embed_bytes (first stage) + head_bytes (last stage)

where a hybrid model's recurrent (Gated DeltaNet) layers hold no KV (``kv_layers`` says
which do) but a fixed state per sequence, the same for any context: ``fixed_layer_bytes``.

bytes of memory. The planner picks the *fewest* stages that fit, stage 0 always on the host
(it serves the API and runs speculation). Among the other nodes it prefers more memory, then
lower round-trip time, then the node id, so the result is deterministic for the same input.

Within a set of stages the layers are split *memory-weighted*: every node is filled to the same
fraction ``alpha`` of its usable memory, and ``alpha`` is the smallest value for which a greedy
left-to-right fill places every layer. That minimises the worst stage's memory utilisation
(a weighted linear partition), so a node with twice the memory gets about twice the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.errors import PlanError

# Bisection steps on alpha: 60 halvings take [0, 1] below 1e-18, far under one byte of any
# real stage, so the result does not depend on float noise.
_ALPHA_STEPS = 60


@dataclass(frozen=True, slots=True)
class ModelFootprint:
    """What the planner needs to know of a model, in bytes as loaded on the devices."""

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    kv_bytes_per_token_per_layer: int
    tied_head: bool = False
    # Hybrid models: whether each layer holds a KV cache (empty: every layer does), and the
    # bytes each layer holds whatever the context (recurrent state and snapshot ring of
    # every live sequence; empty: none).
    kv_layers: tuple[bool, ...] = ()
    fixed_layer_bytes: tuple[int, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    def kv_bytes(self, start: int, end: int, context_tokens: int) -> int:
        """KV bytes of layers ``[start, end)`` for ``context_tokens`` (every live sequence)."""
        kv_layers = sum(self.kv_layers[start:end]) if self.kv_layers else end - start
        return kv_layers * self.kv_bytes_per_token_per_layer * context_tokens


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """One live node as the planner sees it."""

    node_id: str
    usable_memory_bytes: int
    device: str = "cpu"
    rtt_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Node ``node_id`` runs layers ``[start, end)``; ``embed``/``head`` when first/last."""

    node_id: str
    start: int
    end: int
    embed: bool
    head: bool
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    """Stages in pipeline order; stage 0 is on the host."""

    stages: tuple[StagePlan, ...]
    context_tokens: int

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(stage.node_id for stage in self.stages)


def plan(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    host_id: str,
    context_tokens: int,
    split: int | None = None,
) -> Plan:
    """Return the plan with the fewest stages that fit (exactly ``split`` stages if given).

    Raises:
        PlanError: the host is not among ``nodes``, ``split`` cannot be honoured, or the model
            does not fit; the message says how much memory is missing.
    """
    ordered = _candidate_order(nodes, host_id)
    if split is not None:
        if not 1 <= split <= min(len(ordered), model.n_layers):
            raise PlanError(
                f"--split {split} needs {split} nodes and layers; "
                f"{len(ordered)} nodes are alive and the model has {model.n_layers} layers"
            )
        counts: Sequence[int] = [split]
    else:
        counts = range(1, min(len(ordered), model.n_layers) + 1)
    for count in counts:
        stages = _fit(model, ordered[:count], context_tokens)
        if stages is not None:
            return Plan(stages=stages, context_tokens=context_tokens)
    raise PlanError(_shortfall_message(model, ordered[: counts[-1]], context_tokens))


def _candidate_order(nodes: Sequence[NodeCapacity], host_id: str) -> list[NodeCapacity]:
    hosts = [node for node in nodes if node.node_id == host_id]
    if not hosts:
        raise PlanError(f"the host {host_id} is not among the live nodes")
    others = sorted(
        (node for node in nodes if node.node_id != host_id),
        key=lambda node: (-node.usable_memory_bytes, node.rtt_s, node.node_id),
    )
    return [hosts[0], *others]


def _stage_bytes(model: ModelFootprint, start: int, end: int, context_tokens: int) -> int:
    last = end == model.n_layers
    first = start == 0
    total = sum(model.layer_bytes[start:end]) + sum(model.fixed_layer_bytes[start:end])
    total += model.kv_bytes(start, end, context_tokens)
    if first or (last and model.tied_head):
        total += model.embed_bytes
    if last:
        total += model.head_bytes
    return total


def _greedy(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], context_tokens: int, alpha: float
) -> list[tuple[int, int]] | None:
    """Fill nodes left to right up to ``alpha`` of their memory; None if layers are left."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for index, node in enumerate(nodes):
        budget = alpha * node.usable_memory_bytes
        # Leave at least one layer for every node still to come, so no stage is empty.
        limit = model.n_layers - (len(nodes) - index - 1)
        end = start
        while end < limit and _stage_bytes(model, start, end + 1, context_tokens) <= budget:
            end += 1
        if end == start:
            return None
        ranges.append((start, end))
        start = end
    return ranges if start == model.n_layers else None


def _fit(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], context_tokens: int
) -> tuple[StagePlan, ...] | None:
    if _greedy(model, nodes, context_tokens, 1.0) is None:
        return None
    low, high = 0.0, 1.0
    for _ in range(_ALPHA_STEPS):
        middle = (low + high) / 2
        if _greedy(model, nodes, context_tokens, middle) is None:
            low = middle
        else:
            high = middle
    ranges = _greedy(model, nodes, context_tokens, high)
    assert ranges is not None  # high only ever takes values for which the fill succeeded
    return tuple(
        StagePlan(
            node_id=node.node_id,
            start=start,
            end=end,
            embed=start == 0,
            head=end == model.n_layers,
            memory_bytes=_stage_bytes(model, start, end, context_tokens),
        )
        for node, (start, end) in zip(nodes, ranges, strict=True)
    )


def _shortfall_message(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], context_tokens: int
) -> str:
    needed = _stage_bytes(model, 0, model.n_layers, context_tokens)
    available = sum(node.usable_memory_bytes for node in nodes)
    missing = max(needed - available, 0)
    largest_layer = max(model.layer_bytes, default=0)
    detail = (
        f"{_mib(missing)} MiB missing"
        if missing
        else "no contiguous split fits (a single layer or the embedding/head is larger "
        f"than a node's share; largest layer {_mib(largest_layer)} MiB)"
    )
    return (
        f"the model needs {_mib(needed)} MiB for a {context_tokens}-token context but "
        f"{len(nodes)} node(s) offer {_mib(available)} MiB: {detail}"
    )


def _mib(n_bytes: int) -> int:
    return -(-n_bytes // (1 << 20))


def should_regrow(current: Plan, wanted: Plan | None, *, split: int | None, degraded: bool) -> bool:
    """Whether to move a serving run from ``current`` onto ``wanted``.

    ``wanted`` is the plan the planner makes now over the live nodes with ``--split`` as
    asked (``None`` when it cannot). After a loss the host serves on what is left (fewer
    stages than ``--split``, or nodes the planner liked less); when the nodes it wanted
    are back, the plan grows back to them. Rules:

    - nothing to move to (``wanted`` is ``None`` or places the same nodes): stay;
    - ``--split N``: move only from a plan of another size onto one of exactly ``N``
      stages, never between two ``N``-stage plans (their order can differ by RTT noise);
    - no ``--split``: move only while ``degraded`` (the current plan was made after a
      loss), so a healthy mesh is not re-placed every time some node joins.
    """
    if wanted is None or wanted.node_ids == current.node_ids:
        return False
    if split is not None:
        return len(current.stages) != split and len(wanted.stages) == split
    return degraded
