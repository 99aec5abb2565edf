"""The planner: which node runs which contiguous range of layers. A pure function.

Theory of operation. A model is a chain of ``n_layers`` blocks plus the embedding (needed by
the first stage) and the head (needed by the last; when the head is tied to the embedding the
last stage holds the embedding too). A stage running layers ``[start, end)`` needs

    sum(layer_bytes[start:end]) + (end - start) * kv_bytes_per_token_per_layer * context
    + sum(fixed_layer_bytes[start:end]) + embed_bytes (first stage) + head_bytes (last stage)

where a hybrid model's recurrent (Gated DeltaNet) layers hold no KV (``kv_layers`` says
which do) but a fixed state per sequence, the same for any context: ``fixed_layer_bytes``.
A CPU node's stage of a model with K/V per position keeps one pool of blocks instead
(``pool_tokens``; :func:`meshnode.node.prefix.pool_blocks`): its KV term is
``(end - start) * pool_kv_bytes_per_token_per_layer * pool_tokens``.

bytes of memory. The planner picks the *fewest* stages that fit, stage 0 always on the host
(it serves the API and runs speculation). Among the other nodes it prefers more memory, then
the quicker hop (:func:`hop_seconds`), then the node id, so the result is deterministic for
the same input.

Within a set of stages the layers are split *memory-weighted*: every node is filled to the same
fraction ``alpha`` of its usable memory, and ``alpha`` is the smallest value for which a greedy
left-to-right fill places every layer. That minimises the worst stage's memory utilisation
(a weighted linear partition), so a node with twice the memory gets about twice the layers.

**Measured speeds.** When every candidate node reports a :class:`NodeSpeed` (what its
calibration measured for this model), the split follows time instead of memory
(:func:`~meshnode.node.plan_cost.fit_timed`): within a set of stages, an exact dynamic
program over contiguous ranges minimises the slowest stage's time per token (the
pipeline's throughput bound with many streams), then the sum; among stage counts, the one
whose token takes the least time end to end (stage times plus hops) wins, fewer stages on
ties. A measured plan is taken only when it is strictly faster than the memory-weighted
plan of the same nodes, so a tie or a missing measurement gives today's plan.

**Links.** A hop into a stage costs the link's round trip (the heartbeat's) plus the
activation bytes it carries over the link's measured rate (:mod:`meshnode.node.links`):
``ModelFootprint.activation_bytes_per_token`` a decode token, that times the rows of a
prefill chunk. The hop into stage 1 is the host's own link to it; a hop between two
workers is the link they reported between them (``NodeCapacity.links``, the slower of
their two figures), else the host's link to the later one. A link not measured yet counts
its round trip alone. The order of the nodes is a chain by hop from the node before, so a
slow link between two workers keeps them from being neighbours when another node can be.
With many streams a link is a stage of the pipeline too: a token's transfer time counts
beside the stages' compute in the slowest-stage view.

**Larger than memory.** When no set of stages fits, and disk offload is allowed (it is
unless ``--no-disk-offload``), the planner places the model on every candidate node anyway,
memory-weighted past 100 %: each node's share of the shortfall is in proportion to its
memory; or, when every node has measured its compute *and its disk's read rate*, by the
same dynamic program, a stage's time being the slower of its compute and the read of its
bytes past memory (the read-ahead overlaps them), taken when strictly faster. A stage's
KV (and recurrent state) must still fit in its memory, since KV never goes to disk; what
its weights take beyond the rest of its memory (``StagePlan.offload_bytes``) stays in the
memory-mapped file and is read from disk as the stage computes, with read-ahead of the
next layer (``meshnode.engine.readahead``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from meshnode.errors import PlanError
from meshnode.node.plan_cost import (
    cost,
    fit_timed,
    hop_link,
    hop_seconds,
    plan_seconds,
    resident_bytes,
    stage_bytes,
    stage_plans,
    stage_weight_bytes,
)
from meshnode.node.plan_records import (
    ModelFootprint,
    NodeCapacity,
    NodeLink,
    NodeSpeed,
    Plan,
    StagePlan,
)

# The records and the cost model live beside the planner (plan_records, plan_cost); their
# public names are re-exported here, where every caller imports them from.

__all__ = [
    "ModelFootprint",
    "NodeCapacity",
    "NodeLink",
    "NodeSpeed",
    "Plan",
    "StagePlan",
    "hop_link",
    "hop_seconds",
    "plan",
    "plan_seconds",
    "should_regrow",
    "stage_weight_bytes",
]


# Bisection steps on alpha: 60 halvings take [0, 1] below 1e-18, far under one byte of any
# real stage, so the result does not depend on float noise.
_ALPHA_STEPS = 60


def plan(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    host_id: str,
    context_tokens: int,
    split: int | None = None,
    *,
    disk_offload: bool = False,
) -> Plan:
    """Return the plan with the fewest stages that fit (exactly ``split`` stages if given);
    with ``disk_offload``, when none fits, the plan over every candidate node (or ``split``)
    that serves its weights past memory from disk (module docstring).

    Raises:
        PlanError: the host is not among ``nodes``, ``split`` cannot be honoured, or the model
            does not fit (with ``disk_offload``: not even its KV); the message says how much
            memory is missing.
    """
    ordered = _candidate_order(model, nodes, host_id)
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
            timed = _timed_plan(model, nodes, host_id, context_tokens, counts, stages)
            return Plan(timed or stages, context_tokens, measured=timed is not None)
    short = _shortfall_message(model, ordered[: counts[-1]], context_tokens)
    if not disk_offload:
        raise PlanError(f"{short} (disk offload is off: --no-disk-offload)")
    nodes_used = ordered[: counts[-1]]
    stages = _fit(model, nodes_used, context_tokens, alpha_max=_offload_alpha(model, nodes_used))
    if stages is None:
        raise PlanError(f"{short}; not even with disk offload: a stage's KV must fit in memory")
    timed = _timed_plan(model, nodes, host_id, context_tokens, counts[-1:], stages, offload=True)
    return Plan(timed or stages, context_tokens, measured=timed is not None)


def _candidate_order(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    host_id: str,
    *,
    fastest_first: bool = False,
    nearest_first: bool = False,
) -> list[NodeCapacity]:
    """The host, then the other nodes by most memory, then the quickest hop (round trip
    and a token over the link), then node id; ``fastest_first``: by decode rate before
    memory; ``nearest_first``: by hop before anything else.

    A chain: each next node is the best of those left by its hop from the node before it
    (:func:`~meshnode.node.plan_cost.hop_link`: the host's link from the host, the link
    two workers reported between them), so that a slow link between two workers keeps
    them apart. Without such reports every hop is the host's, and the chain is the nodes
    sorted by the same key."""
    hosts = [node for node in nodes if node.node_id == host_id]
    if not hosts:
        raise PlanError(f"the host {host_id} is not among the live nodes")

    def key(node: NodeCapacity) -> tuple[float, float, float, float, str]:
        rate = node.speed.decode_bytes_per_s if node.speed and fastest_first else 0.0
        hop = hop_seconds(model, node, after=after)
        near = hop if nearest_first else 0.0
        return (near, -rate, -node.usable_memory_bytes, hop, node.node_id)

    order, after = [hosts[0]], None  # after: the node the next one's hop comes from
    others = [node for node in nodes if node.node_id != host_id]
    while others:
        after = min(others, key=key)
        others.remove(after)
        order.append(after)
    return order


def _offload_alpha(model: ModelFootprint, nodes: Sequence[NodeCapacity]) -> float:
    """A fill fraction at which any one node's budget holds the whole model: the upper end
    of the search when weights may go past memory."""
    whole = sum(model.layer_bytes) + model.embed_bytes * 2 + model.head_bytes
    whole += sum(model.fixed_layer_bytes)
    smallest = min(node.usable_memory_bytes for node in nodes)
    return max(1.0, whole / max(smallest, 1) + 1.0)


def _greedy(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], context_tokens: int, alpha: float
) -> list[tuple[int, int]] | None:
    """Fill nodes left to right up to ``alpha`` of their memory (past 100 % only for
    weights: KV must fit in memory); None if layers are left."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for index, node in enumerate(nodes):
        budget = alpha * node.usable_memory_bytes
        # Leave at least one layer for every node still to come, so no stage is empty.
        limit = model.n_layers - (len(nodes) - index - 1)
        end = start
        while (
            end < limit
            and stage_bytes(model, start, end + 1, context_tokens, node.device) <= budget
            and resident_bytes(model, start, end + 1, context_tokens, node.device)
            <= node.usable_memory_bytes
        ):
            end += 1
        if end == start:
            return None
        ranges.append((start, end))
        start = end
    return ranges if start == model.n_layers else None


def _fit(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    context_tokens: int,
    alpha_max: float = 1.0,
) -> tuple[StagePlan, ...] | None:
    if _greedy(model, nodes, context_tokens, alpha_max) is None:
        return None
    low, high = 0.0, alpha_max
    for _ in range(_ALPHA_STEPS):
        middle = (low + high) / 2
        if _greedy(model, nodes, context_tokens, middle) is None:
            low = middle
        else:
            high = middle
    ranges = _greedy(model, nodes, context_tokens, high)
    assert ranges is not None  # high only ever takes values for which the fill succeeded
    return stage_plans(model, nodes, ranges, context_tokens)


def _timed_plan(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    host_id: str,
    context_tokens: int,
    counts: Sequence[int],
    weighted: tuple[StagePlan, ...],
    *,
    offload: bool = False,
) -> tuple[StagePlan, ...] | None:
    """The measured plan, when every node is measured and it beats ``weighted``; else None.
    With ``offload`` (the mesh's memory is short) every node's disk rate must be measured
    too, and a stage's weights may pass its memory (:func:`~meshnode.node.plan_cost.
    stage_seconds` counts the disk).

    Stage counts from ``weighted``'s (the fewest that fit) up to the largest allowed are
    tried, each over the choices of nodes of :func:`_orders`; the plan whose token
    takes the least time end to end wins, the one with fewer stages (then the first found)
    on ties.
    """
    if any(node.speed is None for node in nodes):
        return None
    if offload and any(node.speed and not node.speed.disk_bytes_per_s for node in nodes):
        return None
    best, best_cost = None, cost(model, nodes, weighted)
    for count in (c for c in counts if c >= len(weighted)):
        for order in _orders(model, nodes, host_id):
            chosen = order[:count]
            stages = fit_timed(model, chosen, context_tokens, offload=offload)
            if stages is not None and (seconds := cost(model, nodes, stages)) < best_cost:
                best, best_cost = stages, seconds
    return best


def _orders(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], host_id: str
) -> list[list[NodeCapacity]]:
    """The orders of nodes a measured plan tries (:func:`_timed_plan`), each once: the most
    memory first, the fastest first and the quickest hop first, each with the links
    counted and without them, and with the links between workers and without them, so
    that a measured link only ever adds choices to a plan made without it."""
    blind = ModelFootprint((), 0, 0, 0)  # no activation bytes: a hop is its round trip
    unlinked = [dataclasses.replace(node, links=()) for node in nodes]
    by_id = {node.node_id: node for node in nodes}
    orders: list[list[NodeCapacity]] = []
    seen: set[tuple[str, ...]] = set()
    for among, footprint in itertools.product((nodes, unlinked), (model, blind)):
        for fastest, nearest in ((False, False), (True, False), (False, True)):
            order = _candidate_order(
                footprint, among, host_id, fastest_first=fastest, nearest_first=nearest
            )
            if (ids := tuple(node.node_id for node in order)) not in seen:
                seen.add(ids)
                orders.append([by_id[node_id] for node_id in ids])
    return orders


def _shortfall_message(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], context_tokens: int
) -> str:
    needed = min(stage_bytes(model, 0, model.n_layers, context_tokens, n.device) for n in nodes)
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
