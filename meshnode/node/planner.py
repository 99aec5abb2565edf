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
(:func:`_fit_timed`): within a set of stages, an exact dynamic program over
contiguous ranges minimises the slowest stage's time per token (the pipeline's throughput
bound with many streams), then the sum; among stage counts, the one whose token takes the
least time end to end (stage times plus hops) wins, fewer stages on ties. A
measured plan is taken only when it is strictly faster than the memory-weighted plan of the
same nodes, so a tie or a missing measurement gives today's plan.

**Links.** A hop into a stage costs the node's round trip to the host (the heartbeat's)
plus the activation bytes it carries over the host's measured link to the node
(:mod:`meshnode.node.links`): ``ModelFootprint.activation_bytes_per_token`` a decode token,
that times the rows of a prefill chunk. A link not measured yet counts its round trip
alone. With many streams a link is a stage of the pipeline too: a token's transfer time
counts beside the stages' compute in the slowest-stage view.

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

import itertools
from collections.abc import Callable, Sequence
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
    # What a hop carries a token: one row of activations at the wire dtype (0: not counted).
    activation_bytes_per_token: int = 0
    # A CPU stage's pool of KV blocks (issue 30): positions it holds for a context (None:
    # every live sequence preallocates its context there too), at one sequence's bytes.
    pool_tokens: Callable[[int], int] | None = None
    pool_kv_bytes_per_token_per_layer: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    def kv_bytes(self, start: int, end: int, context_tokens: int, device: str) -> int:
        """KV bytes of layers ``[start, end)`` for ``context_tokens`` on a ``device`` node:
        a CPU node's pool, else every live sequence's context."""
        kv_layers = sum(self.kv_layers[start:end]) if self.kv_layers else end - start
        if device == "cpu" and self.pool_tokens is not None:
            per_layer = self.pool_kv_bytes_per_token_per_layer * self.pool_tokens(context_tokens)
            return kv_layers * per_layer
        return kv_layers * self.kv_bytes_per_token_per_layer * context_tokens


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """One live node as the planner sees it."""

    node_id: str
    usable_memory_bytes: int
    device: str = "cpu"
    rtt_s: float = 0.0
    speed: NodeSpeed | None = None
    # the measured rate of the host's link to the node (meshnode.node.links); 0: unknown
    link_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.link_bytes_per_s < float("inf"):
            raise ValueError(
                f"link_bytes_per_s must be >= 0 and finite, not {self.link_bytes_per_s}"
            )


@dataclass(frozen=True, slots=True)
class NodeSpeed:
    """What a node measured of itself for one model (its calibration), as rates.

    ``decode_bytes_per_s``: layer weight bytes one decode step of one row gets through per
    second on the node's backend, threads and the model's own formats (a stage of ``B``
    weight bytes takes ``B / decode_bytes_per_s`` seconds a token).
    """

    decode_bytes_per_s: float
    # the read rate of the node's disk (its model file), for weight bytes served past its
    # memory (module docstring, Larger than memory); 0: not measured
    disk_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        rate = self.decode_bytes_per_s
        # NaN fails both comparisons; an infinite rate would make every stage free
        if not 0.0 < rate < float("inf"):
            raise ValueError(f"decode_bytes_per_s must be positive and finite, not {rate}")
        if not 0.0 <= self.disk_bytes_per_s < float("inf"):
            raise ValueError(
                f"disk_bytes_per_s must be >= 0 and finite, not {self.disk_bytes_per_s}"
            )


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Node ``node_id`` runs layers ``[start, end)``; ``embed``/``head`` when first/last."""

    node_id: str
    start: int
    end: int
    embed: bool
    head: bool
    memory_bytes: int
    # bytes past the node's usable memory, served from the memory-mapped file (module
    # docstring, Larger than memory); 0 when the stage fits
    offload_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """Stages in pipeline order; stage 0 is on the host."""

    stages: tuple[StagePlan, ...]
    context_tokens: int
    measured: bool = False  # placed by the nodes' measured speeds, not by memory

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(stage.node_id for stage in self.stages)


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
    memory; ``nearest_first``: by hop before anything else."""
    hosts = [node for node in nodes if node.node_id == host_id]
    if not hosts:
        raise PlanError(f"the host {host_id} is not among the live nodes")

    def key(node: NodeCapacity) -> tuple[float, float, float, float, str]:
        rate = node.speed.decode_bytes_per_s if node.speed and fastest_first else 0.0
        hop = hop_seconds(model, node)
        near = hop if nearest_first else 0.0
        return (near, -rate, -node.usable_memory_bytes, hop, node.node_id)

    others = sorted((node for node in nodes if node.node_id != host_id), key=key)
    return [hosts[0], *others]


def _stage_bytes(
    model: ModelFootprint, start: int, end: int, context_tokens: int, device: str
) -> int:
    last = end == model.n_layers
    first = start == 0
    total = sum(model.layer_bytes[start:end]) + sum(model.fixed_layer_bytes[start:end])
    total += model.kv_bytes(start, end, context_tokens, device)
    if first or (last and model.tied_head):
        total += model.embed_bytes
    if last:
        total += model.head_bytes
    return total


def _resident_bytes(
    model: ModelFootprint, start: int, end: int, context_tokens: int, device: str
) -> int:
    """What a stage must hold in memory whatever is offloaded: its KV and recurrent state."""
    fixed = sum(model.fixed_layer_bytes[start:end])
    return model.kv_bytes(start, end, context_tokens, device) + fixed


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
            and _stage_bytes(model, start, end + 1, context_tokens, node.device) <= budget
            and _resident_bytes(model, start, end + 1, context_tokens, node.device)
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
    return _stages(model, nodes, ranges, context_tokens)


def _stages(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    ranges: Sequence[tuple[int, int]],
    context_tokens: int,
) -> tuple[StagePlan, ...]:
    stages = []
    for node, (start, end) in zip(nodes, ranges, strict=True):
        memory = _stage_bytes(model, start, end, context_tokens, node.device)
        stages.append(
            StagePlan(
                node_id=node.node_id,
                start=start,
                end=end,
                embed=start == 0,
                head=end == model.n_layers,
                memory_bytes=memory,
                offload_bytes=max(0, memory - node.usable_memory_bytes),
            )
        )
    return tuple(stages)


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
    too, and a stage's weights may pass its memory (:func:`_seconds` counts the disk).

    Stage counts from ``weighted``'s (the fewest that fit) up to the largest allowed are
    tried, each over the choices of nodes of :func:`_orders`; the plan whose token
    takes the least time end to end wins, the one with fewer stages (then the first found)
    on ties.
    """
    if any(node.speed is None for node in nodes):
        return None
    if offload and any(node.speed and not node.speed.disk_bytes_per_s for node in nodes):
        return None
    best, best_cost = None, _cost(model, nodes, weighted)
    for count in (c for c in counts if c >= len(weighted)):
        for order in _orders(model, nodes, host_id):
            chosen = order[:count]
            stages = _fit_timed(model, chosen, context_tokens, offload=offload)
            if stages is not None and (cost := _cost(model, nodes, stages)) < best_cost:
                best, best_cost = stages, cost
    return best


def _orders(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], host_id: str
) -> list[list[NodeCapacity]]:
    """The orders of nodes a measured plan tries (:func:`_timed_plan`), each once: the most
    memory first, the fastest first and the quickest hop first, each with the links
    counted and without them, so that a measured link only ever adds choices to a plan
    made without it."""
    blind = ModelFootprint((), 0, 0, 0)  # no activation bytes: a hop is its round trip
    orders: list[list[NodeCapacity]] = []
    for footprint in (model, blind):
        for fastest, nearest in ((False, False), (True, False), (False, True)):
            order = _candidate_order(
                footprint, nodes, host_id, fastest_first=fastest, nearest_first=nearest
            )
            if order not in orders:
                orders.append(order)
    return orders


def stage_weight_bytes(model: ModelFootprint, stage: StagePlan) -> int:
    """Weight bytes one token reads on ``stage`` (its layers, and the head when last): what
    its compute time is measured against (:mod:`meshnode.node.speeds`)."""
    return _weight_bytes(model, stage.start, stage.end)


def _weight_bytes(model: ModelFootprint, start: int, end: int) -> int:
    """Weight bytes a token reads in layers ``[start, end)`` (and the head when last)."""
    head = model.head_bytes if end == model.n_layers else 0
    return sum(model.layer_bytes[start:end]) + head


def plan_seconds(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], stages: Sequence[StagePlan]
) -> tuple[float, float] | None:
    """``(one token's time end to end, the slowest stage's time)`` through ``stages``, in
    seconds, predicted from ``nodes``' measured speeds; None when a stage's node is not
    among them or is unmeasured."""
    by_id = {node.node_id: node for node in nodes}
    if any(by_id.get(s.node_id) is None or by_id[s.node_id].speed is None for s in stages):
        return None
    return _cost(model, nodes, stages)


def _seconds(node: NodeCapacity, weight_bytes: int, offload_bytes: int = 0) -> float:
    """A stage's time a token on ``node``: its compute, or, when ``offload_bytes`` of its
    weights come from disk, the slower of that and their read (the read-ahead overlaps
    the two: :mod:`meshnode.engine.readahead`); an unmeasured disk is not counted."""
    assert node.speed is not None  # only measured nodes are timed
    compute = weight_bytes / node.speed.decode_bytes_per_s
    disk = node.speed.disk_bytes_per_s
    return max(compute, offload_bytes / disk) if offload_bytes and disk else compute


def hop_seconds(model: ModelFootprint, node: NodeCapacity, rows: int = 1) -> float:
    """The time of the hop into ``node``'s stage carrying ``rows`` rows (1: a decode token;
    a prefill chunk's tokens): the node's round trip to the host plus the rows' activation
    bytes over the host's measured link to it (the link is not counted while unmeasured)."""
    link = node.link_bytes_per_s
    transfer = rows * model.activation_bytes_per_token / link if link else 0.0
    return node.rtt_s + transfer


def _cost(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], stages: Sequence[StagePlan]
) -> tuple[float, float]:
    """``(one token's time end to end, the slowest stage's or link's time)``, in seconds.

    End to end: every stage's compute plus each hop (:func:`hop_seconds`: the node's round
    trip to the host, plus a token's activations over the link, where measured). With many
    streams, a link is a stage of the pipeline too: its transfer time a token counts
    beside the stages' compute (the round trip overlaps other streams' work).
    """
    by_id = {node.node_id: node for node in nodes}
    times = [
        _seconds(by_id[s.node_id], _weight_bytes(model, s.start, s.end), s.offload_bytes)
        for s in stages
    ]
    hops = [hop_seconds(model, by_id[s.node_id]) for s in stages[1:]]
    transfers = [hop - by_id[s.node_id].rtt_s for hop, s in zip(hops, stages[1:], strict=True)]
    return (sum(times) + sum(hops), max([*times, *transfers]))


def _fit_timed(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    context_tokens: int,
    *,
    offload: bool = False,
) -> tuple[StagePlan, ...] | None:
    """Contiguous ranges over ``nodes`` in order minimising the slowest stage, then the sum.

    An exact dynamic program: ``best[i][end]`` is the best ``(slowest, sum)`` placing layers
    ``[0, end)`` on the first ``i + 1`` nodes, every node at least one layer and within its
    memory (with ``offload``: its KV within its memory, the weights past it read from disk
    at the node's disk rate). ``O(len(nodes) * n_layers**2)`` stage evaluations: 16 nodes
    of a 128-layer model are ~260,000, well under a second, and plans are made only when
    the mesh changes.
    """
    n_layers, count = model.n_layers, len(nodes)
    spans = [(start, end) for start in range(n_layers) for end in range(start + 1, n_layers + 1)]
    # what a range costs is the same on every node of a device: work it out once for each
    devices = {node.device for node in nodes}
    memory, resident = {}, {}
    for (start, end), device in itertools.product(spans, devices):
        memory[start, end, device] = _stage_bytes(model, start, end, context_tokens, device)
        resident[start, end, device] = _resident_bytes(model, start, end, context_tokens, device)
    weights = {span: _weight_bytes(model, *span) for span in spans}
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n_layers + 1) for _ in range(count)]
    cut = [[0] * (n_layers + 1) for _ in range(count)]
    for index, node in enumerate(nodes):
        # node ``index`` ends its range at ``end``; the nodes after it need a layer each
        for end in range(index + 1, n_layers - (count - index - 1) + 1):
            for start in range(index, end) if index else (0,):
                before = best[index - 1][start] if index else (0.0, 0.0)
                room = node.usable_memory_bytes
                over = memory[start, end, node.device] - room
                held = resident[start, end, node.device]
                if before == inf or (over > 0 and not offload) or held > room:
                    continue
                seconds = _seconds(node, weights[start, end], max(over, 0))
                value = (max(before[0], seconds), before[1] + seconds)
                if value < best[index][end]:
                    best[index][end], cut[index][end] = value, start
    if best[-1][n_layers] == inf:
        return None
    ranges, end = [], n_layers
    for index in reversed(range(count)):
        ranges.append((cut[index][end], end))
        end = cut[index][end]
    return _stages(model, nodes, ranges[::-1], context_tokens)


def _shortfall_message(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], context_tokens: int
) -> str:
    needed = min(_stage_bytes(model, 0, model.n_layers, context_tokens, n.device) for n in nodes)
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
