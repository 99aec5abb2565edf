"""What the nodes claim of their own speed, bounded, as the planner's :class:`NodeSpeed`.

Theory of operation. Every node measures itself when it prepares its part of a model
(:mod:`meshnode.node.selfmeasure`) and reports it in its ``InventoryReport``; the host
measures its own stage 0 the same way. :class:`ClaimBook` turns each report into a decode
rate in the planner's units (the footprint's bytes of the layer timed, over the time per
token it claims) and a disk rate. A claim is another node's word: :func:`claimed_speed`
refuses a NaN, a negative, zero or absurd figure with a clear reason, and such a node is
planned by memory. A claim only places layers until serving measures the node itself:
the coordinator prefers the rates it observes (:class:`~meshnode.node.speeds.SpeedBook`),
so a node that lies gets the layers its lie earns for one bring-up, and is then re-placed
by what it really does (the calibration request and the serving watch).

A report also carries the node's measured links to its peers (round trip and rate), which
the planner uses for the hop between two workers' stages. :func:`claimed_links` bounds
them: a figure that is not a finite number of at least 0 is dropped, a rate is capped at
the fastest link believed and a round trip at :data:`MAX_RTT_S`, and at most
:data:`MAX_LINKS` of a report are kept. A lying node can only move where its own stage
goes: the planner takes the slower of the two ends' figures, so it can make its links
look slower, never faster than its neighbour measured them.

With ``--placement memory`` the book keeps the links alone (``compute=False``): a user who
asks for memory placement asks that the nodes' compute speeds not move layers, while the
links are still the network the hops cross, so the status times each hop by the link it
crosses and the plans after the nodes reported (a loss, a join) order them by it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import psutil
from meshnode_protocol import InventoryReport, PeerLink, SpeedReport

from meshnode.node.links import MAX_LINK_BYTES_PER_S, MAX_REPORTED_LINKS
from meshnode.node.planner import ModelFootprint, NodeCapacity, NodeLink, NodeSpeed
from meshnode.node.selfmeasure import SelfMeasure, report_fields
from meshnode.node.speeds import MAX_BYTES_PER_S

__all__ = [
    "MAX_DISK_BYTES_PER_S",
    "MAX_LAYER_S",
    "MAX_LINKS",
    "MAX_RTT_S",
    "ClaimBook",
    "best_speed",
    "claimed_links",
    "claimed_speed",
]

#: Longest time per layer and token a node may claim: a minute a layer is no machine that
#: could serve a model (a token through 32 such layers would take half an hour).
MAX_LAYER_S = 60.0
#: Fastest disk a node may claim: a RAID of PCIe 5 NVMe drives reads ~50 GB/s.
MAX_DISK_BYTES_PER_S = 1e11
#: Longest round trip a node may claim to a peer: a minute is past any heartbeat's timeout
#: (a peer that far away is dead to the membership, not slow).
MAX_RTT_S = 60.0
#: Links kept of one report: what an honest node sends at most (links.MAX_REPORTED_LINKS);
#: bounds what a node that lists made-up peers makes the host keep and the planner read.
MAX_LINKS = MAX_REPORTED_LINKS


def claimed_speed(report: InventoryReport, model: ModelFootprint) -> NodeSpeed | None:
    """The speed ``report`` claims for ``model``: None when it claims none (not measured,
    or the node's own reason in ``measure_error``).

    Raises:
        ValueError: a figure is not a finite number in its bounds, or the layer timed
            (the first of the report's ready range) is not one of the model's.
    """
    if report.measure_error or not report.decode_us or not report.ready:
        return None
    for name in ("decode_us", "batch_us", "prefill_us"):
        value = getattr(report, name)
        if not (math.isfinite(value) and 0.0 <= value <= MAX_LAYER_S * 1e6):
            raise ValueError(f"{name} {value} is not a time per layer in [0, {MAX_LAYER_S} s]")
    disk = report.disk_bytes_per_s
    if not (math.isfinite(disk) and 0.0 <= disk <= MAX_DISK_BYTES_PER_S):
        raise ValueError(f"disk_bytes_per_s {disk} is not in [0, {MAX_DISK_BYTES_PER_S:.0e}]")
    layer = report.ready[0][0]
    if not 0 <= layer < model.n_layers:
        raise ValueError(f"layer {layer} is not one of the model's {model.n_layers}")
    rate = model.layer_bytes[layer] / (report.decode_us * 1e-6)
    if rate > MAX_BYTES_PER_S:
        raise ValueError(f"a decode rate of {rate:.3g} B/s is beyond any machine")
    return NodeSpeed(rate, disk)


def claimed_links(node: str, links: tuple[PeerLink, ...]) -> tuple[NodeLink, ...]:
    """What ``node`` reported of its links to its peers, bounded (module docstring): a
    figure that is not finite and at least 0 is taken as not measured (0), a rate is
    capped at ``MAX_LINK_BYTES_PER_S`` and a round trip at :data:`MAX_RTT_S`; a link to
    itself, a repeated peer and all past :data:`MAX_LINKS` are left out, as is a link
    with neither figure."""
    kept: dict[str, NodeLink] = {}
    for link in links:
        if len(kept) == MAX_LINKS:
            break
        if link.node_id in kept or link.node_id == node or not link.node_id:
            continue
        rtt = _bounded(link.rtt_us / 1e6, MAX_RTT_S)
        rate = _bounded(link.bytes_per_s, MAX_LINK_BYTES_PER_S)
        if rtt or rate:
            kept[link.node_id] = NodeLink(link.node_id, rtt, rate)
    return tuple(kept.values())


def _bounded(value: float, most: float) -> float:
    return min(value, most) if math.isfinite(value) and value >= 0.0 else 0.0


def best_speed(observed: NodeSpeed | None, claimed: NodeSpeed | None) -> NodeSpeed | None:
    """What the planner uses of a node: the decode rate serving observed when there is one
    (with the disk rate it claimed: serving does not measure disks), else its claim."""
    if observed is None or claimed is None:
        return observed or claimed
    return NodeSpeed(observed.decode_bytes_per_s, claimed.disk_bytes_per_s)


def _report(node: str, measured: SelfMeasure, layer: int) -> InventoryReport:
    """The host's own measurement as the report a node would send of it."""
    fields = report_fields(measured)
    free = int(psutil.virtual_memory().available)
    return InventoryReport(
        run_id="",
        term=0,
        node_id=node,
        package_ref="",
        ready=((layer, layer + 1),),
        free_memory=free,
        **fields,
    )


#: The measurement's fields, the same in a ``SpeedReport`` as in an ``InventoryReport``.
CACHED_FIELDS = ("decode_us", "batch_us", "prefill_us", "layer_bytes", "disk_bytes_per_s")


class ClaimBook:
    """Each node's latest claim for one model: its speed, or why there is none, and its
    links; ``compute=False`` (``--placement memory``): its links alone."""

    def __init__(self, model: ModelFootprint, *, compute: bool = True) -> None:
        self._model = model
        self.compute = compute
        self._speeds: dict[str, NodeSpeed] = {}
        self._shown: dict[str, dict[str, Any]] = {}
        self._links: dict[str, tuple[NodeLink, ...]] = {}

    def record(self, node: str, report: InventoryReport) -> None:
        """A prepared node's report: keep its claim, or the reason it has none, and the
        links to its peers it reports (its links alone when the book keeps no compute
        claims)."""
        self.record_links(node, report.links)
        if not self.compute:
            return
        try:
            speed = claimed_speed(report, self._model)
        except ValueError as exc:
            speed, reason = None, f"claim refused: {exc}"
        else:
            reason = report.measure_error or ("" if speed else "not measured")
        self._speeds.pop(node, None)
        if speed is not None:
            self._speeds[node] = speed
            self._shown[node] = _shown(report)
        else:
            self._shown[node] = {"error": reason[:200]}

    def record_cached(self, node: str, report: SpeedReport) -> None:
        """A node's answer to a ``SpeedQuery`` (:mod:`meshnode.node.warm`): the measurement
        it keeps cached, bounded as a prepared node's report is. An empty answer (nothing
        cached) changes nothing but the links: the node is measured when it prepares."""
        self.record_links(node, report.links)
        if not report.decode_us:
            return
        if report.layer >= self._model.n_layers:
            self._speeds.pop(node, None)
            self._shown[node] = {"error": f"claim refused: layer {report.layer} is not one of "
                                          f"the model's {self._model.n_layers}"}  # fmt: skip
            return
        layer = report.layer
        fields = {name: getattr(report, name) for name in CACHED_FIELDS}
        self.record(node, InventoryReport(
            run_id="", term=0, node_id=node, package_ref=report.package_ref,
            ready=((layer, layer + 1),), links=report.links, **fields,
        ))  # fmt: skip

    def record_own(self, node: str, measured: SelfMeasure | str, layer: int) -> None:
        """The host's measurement of its own stage (or why it failed)."""
        if not self.compute:
            return
        if isinstance(measured, str):
            self._speeds.pop(node, None)
            self._shown[node] = {"error": measured[:200]}
        else:
            self.record(node, _report(node, measured, layer))

    def record_links(self, node: str, links: tuple[PeerLink, ...]) -> None:
        """``node``'s links to its peers as it reported them, bounded (:func:`claimed_links`)."""
        self._links[node] = claimed_links(node, links)

    def linked(self, node: NodeCapacity) -> NodeCapacity:
        """``node`` with the links to its peers it reported last (none if it never did)."""
        return dataclasses.replace(node, links=self._links.get(node.node_id, ()))

    def speed(self, node: str) -> NodeSpeed | None:
        """The node's claimed speed, if it made a claim within bounds."""
        return self._speeds.get(node)

    def shown(self, node: str) -> dict[str, Any] | None:
        """The node's claim as the status shows it (µs per layer per token, MB/s), or its
        error; None when it never reported."""
        return self._shown.get(node)


def _shown(report: InventoryReport) -> dict[str, Any]:
    return {
        "decode_us": round(report.decode_us, 1),
        "batch8_us": round(report.batch_us, 1),
        "prefill_us": round(report.prefill_us, 1),
        "disk_mb_s": round(report.disk_bytes_per_s / 1e6),
        "free_memory": report.free_memory,
    }
