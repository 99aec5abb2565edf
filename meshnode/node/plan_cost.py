"""The planner's cost model: what a stage holds in memory, what a token's pass through it
and the hops between stages take, and the exact dynamic program that splits layers over
an order of nodes by time (:mod:`meshnode.node.planner`'s module docstring, Measured
speeds, Links and Larger than memory, says why each is counted as it is).

Pure functions of :mod:`meshnode.node.plan_records`' records.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from meshnode.node.plan_records import ModelFootprint, NodeCapacity, NodeLink, StagePlan


def stage_bytes(
    model: ModelFootprint, start: int, end: int, context_tokens: int, device: str
) -> int:
    """What a stage of layers ``[start, end)`` holds on a ``device`` node: its weights,
    KV and recurrent state, and the embedding and head when first or last."""
    last = end == model.n_layers
    first = start == 0
    total = sum(model.layer_bytes[start:end]) + sum(model.fixed_layer_bytes[start:end])
    total += model.kv_bytes(start, end, context_tokens, device)
    if first or (last and model.tied_head):
        total += model.embed_bytes
    if last:
        total += model.head_bytes
    return total


def resident_bytes(
    model: ModelFootprint, start: int, end: int, context_tokens: int, device: str
) -> int:
    """What a stage must hold in memory whatever is offloaded: its KV and recurrent state."""
    fixed = sum(model.fixed_layer_bytes[start:end])
    return model.kv_bytes(start, end, context_tokens, device) + fixed


def stage_plans(
    model: ModelFootprint,
    nodes: Sequence[NodeCapacity],
    ranges: Sequence[tuple[int, int]],
    context_tokens: int,
) -> tuple[StagePlan, ...]:
    """The stages that run ``ranges`` on ``nodes``, in order, with their memory and what
    of it is past the node's (served from disk)."""
    stages = []
    for node, (start, end) in zip(nodes, ranges, strict=True):
        memory = stage_bytes(model, start, end, context_tokens, node.device)
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


def stage_weight_bytes(model: ModelFootprint, stage: StagePlan) -> int:
    """Weight bytes one token reads on ``stage`` (its layers, and the head when last): what
    its compute time is measured against (:mod:`meshnode.node.speeds`)."""
    return weight_bytes(model, stage.start, stage.end)


def weight_bytes(model: ModelFootprint, start: int, end: int) -> int:
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
    return cost(model, nodes, stages)


def stage_seconds(node: NodeCapacity, weight_bytes: int, offload_bytes: int = 0) -> float:
    """A stage's time a token on ``node``: its compute, or, when ``offload_bytes`` of its
    weights come from disk, the slower of that and their read (the read-ahead overlaps
    the two: :mod:`meshnode.engine.readahead`); an unmeasured disk is not counted."""
    assert node.speed is not None  # only measured nodes are timed
    compute = weight_bytes / node.speed.decode_bytes_per_s
    disk = node.speed.disk_bytes_per_s
    return max(compute, offload_bytes / disk) if offload_bytes and disk else compute


def hop_link(node: NodeCapacity, after: NodeCapacity | None = None) -> tuple[float, float]:
    """``(round trip in seconds, rate in bytes a second)`` of the hop into ``node``'s stage
    from ``after``'s (None: from the host's, stage 0).

    From the host: the host's own measurements of its link to ``node``. Between two
    workers: the link as the two reported it (:class:`NodeLink`), the slower figure where
    both did, so that a node can make its links look slower but never faster than its
    neighbour measured them; a figure neither reported is the host's link to ``node``, as
    it was before links between workers were known (a 0 rate: not counted)."""
    rtt, rate = node.rtt_s, node.link_bytes_per_s
    if after is None:
        return rtt, rate
    said = [link for link in (_reported(node, after), _reported(after, node)) if link]
    rtts = [link.rtt_s for link in said if link.rtt_s]
    rates = [link.bytes_per_s for link in said if link.bytes_per_s]
    return (max(rtts) if rtts else rtt, min(rates) if rates else rate)


def _reported(node: NodeCapacity, peer: NodeCapacity) -> NodeLink | None:
    return next((link for link in node.links if link.node_id == peer.node_id), None)


def transfer_seconds(
    model: ModelFootprint, node: NodeCapacity, rows: int = 1, after: NodeCapacity | None = None
) -> float:
    """The time ``rows`` rows of activations take over the link of the hop into ``node``'s
    stage from ``after``'s (:func:`hop_link`); 0 while its rate is not measured."""
    rate = hop_link(node, after)[1]
    return rows * model.activation_bytes_per_token / rate if rate else 0.0


def hop_seconds(
    model: ModelFootprint, node: NodeCapacity, rows: int = 1, *, after: NodeCapacity | None = None
) -> float:
    """The time of the hop into ``node``'s stage from ``after``'s (None: the host's)
    carrying ``rows`` rows (1: a decode token; a prefill chunk's tokens): the link's round
    trip plus the rows' activation bytes over its rate (:func:`hop_link`; the rate is not
    counted while unmeasured)."""
    return hop_link(node, after)[0] + transfer_seconds(model, node, rows, after)


def cost(
    model: ModelFootprint, nodes: Sequence[NodeCapacity], stages: Sequence[StagePlan]
) -> tuple[float, float]:
    """``(one token's time end to end, the slowest stage's or link's time)``, in seconds.

    End to end: every stage's compute plus each hop (:func:`hop_seconds`: the link's round
    trip, plus a token's activations over it, where measured; between two workers the
    link they reported, :func:`hop_link`). With many
    streams, a link is a stage of the pipeline too: its transfer time a token counts
    beside the stages' compute (the round trip overlaps other streams' work).
    """
    by_id = {node.node_id: node for node in nodes}
    times = [
        stage_seconds(by_id[s.node_id], weight_bytes(model, s.start, s.end), s.offload_bytes)
        for s in stages
    ]
    # the hop into stage i comes from stage i - 1: the host's own link into stage 1
    pairs = [
        (by_id[s.node_id], by_id[stages[i - 1].node_id] if i > 1 else None)
        for i, s in enumerate(stages)
        if i
    ]
    hops = [hop_seconds(model, node, after=after) for node, after in pairs]
    transfers = [transfer_seconds(model, node, 1, after) for node, after in pairs]
    return (sum(times) + sum(hops), max([*times, *transfers]))


def fit_timed(
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
        memory[start, end, device] = stage_bytes(model, start, end, context_tokens, device)
        resident[start, end, device] = resident_bytes(model, start, end, context_tokens, device)
    weights = {span: weight_bytes(model, *span) for span in spans}
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
                seconds = stage_seconds(node, weights[start, end], max(over, 0))
                value = (max(before[0], seconds), before[1] + seconds)
                if value < best[index][end]:
                    best[index][end], cut[index][end] = value, start
    if best[-1][n_layers] == inf:
        return None
    ranges, end = [], n_layers
    for index in reversed(range(count)):
        ranges.append((cut[index][end], end))
        end = cut[index][end]
    return stage_plans(model, nodes, ranges[::-1], context_tokens)
