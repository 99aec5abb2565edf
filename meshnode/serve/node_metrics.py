"""The ``/metrics`` of every node, host and workers alike: node, peers, stages, KV caches,
and the latency of each HTTP request.

Everything but the request latency is read from the node's status body (the JSON of
``GET /v1/mesh/status``) when ``/metrics`` is scraped, so the numbers a scraper sees are
the ones ``meshnode status`` prints; :func:`status_metrics` is a pure function of it.
:class:`RequestTimer` is an ASGI middleware that observes each request from its first
byte in to its last byte out (a streamed reply counts until its last event), by route
template, method and status, each label from a bounded set; it sits inside the API guard,
so a request refused there (no key, wrong Host) is never timed.

Families (all prefixed ``meshnode_``): ``node_info``, ``node_uptime_seconds``,
``node_usable_memory_bytes``, ``refused_handshakes_total``, ``protocol_errors_total``,
``internal_errors_total``; ``peers{state}``, ``peer_up{peer}``, ``peer_rtt_seconds{peer}``,
``peer_last_seen_seconds{peer}``; ``stage_ready{node_id,layers}`` (on the host one per
planned stage, on a worker its own), ``mesh_state{state}`` (host; one is 1);
``kv_cache_sequences``, ``kv_cache_max_sequences``, ``kv_cache_used_tokens``,
``kv_cache_capacity_tokens``, ``kv_cache_usage_ratio`` (by ``role``: the host's stage 0 or
the worker's stage); ``prefix_cache_blocks{role,state}`` (used, cached, free),
``prefix_cache_hit_tokens_total``, ``prefix_cache_miss_tokens_total``,
``prefix_cache_evicted_blocks_total`` (by ``role``, where the stage keeps a prefix cache);
``http_request_duration_seconds{method,route,status}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnode.node.coordinator import MeshState
from meshnode.serve.metrics import REQUEST_BUCKETS_S, Histogram, Labels, Sample, family

__all__ = ["RequestTimer", "method_label", "request_histogram", "status_metrics"]

#: Peer states the membership table knows (``meshnode.node.membership.PeerState``), each
#: always exported so a dashboard sees 0 rather than a missing series.
PEER_STATES = ("alive", "suspect", "dead")
#: Coordinator states (``meshnode.node.coordinator``), one-hot in ``mesh_state``.
MESH_STATES = ("starting", *MeshState)  # "starting": no coordinator yet
#: The route label of requests no route matched: unmatched paths must not each make a series.
UNMATCHED_ROUTE = "unmatched"
#: Method label values kept as sent (RFC 9110's methods plus PATCH); any other method, which
#: a client may invent freely and make kilobytes long, is labelled :data:`OTHER_LABEL`, so a
#: stranger cannot grow ``/metrics`` one series per request (issue 36, item 2).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS",
                           "TRACE", "PATCH"})  # fmt: skip
#: The label value that stands for every value outside a label's bounded set.
OTHER_LABEL = "other"


def status_metrics(status: Mapping[str, Any]) -> Iterable[str]:
    """Exposition lines for the node status body ``status`` (fields it lacks are skipped)."""
    node = status.get("node", {})
    yield from _node(node)
    yield from _peers(status.get("peers", []))
    host = status.get("host")
    run = status.get("run")
    yield from _stages(host, run, str(node.get("node_id", "")))
    if host is not None:
        state = str(host.get("state", "starting"))
        samples = [((("state", s),), float(s == state)) for s in MESH_STATES]
        yield from family("meshnode_mesh_state", "gauge", "The host's mesh state (one is 1).",
                          samples)  # fmt: skip
    kv = [("host", host.get("kv")) if host else None, ("worker", run.get("kv")) if run else None]
    yield from _kv([(role, usage) for role, usage in filter(None, kv) if usage])


def _node(node: Mapping[str, Any]) -> Iterable[str]:
    info: Labels = tuple(
        (key, str(node[key]))
        for key in ("node_id", "mesh_name", "device", "protocol_version")
        if key in node
    )
    yield from family("meshnode_node_info", "gauge", "This node (value 1).", [(info, 1.0)])
    gauges = [
        ("uptime_s", "meshnode_node_uptime_seconds", "Seconds since the node started."),
        ("usable_memory", "meshnode_node_usable_memory_bytes", "Memory offered to the mesh."),
    ]
    for key, name, text in gauges:
        if key in node:
            yield from family(name, "gauge", text, [((), float(node[key]))])
    counters = [
        ("refused_handshakes", "TLS handshakes refused (no or wrong mesh token)."),
        ("protocol_errors", "Connections closed for a malformed frame."),
        ("internal_errors", "Connections closed for an error of this node."),
    ]
    for key, text in counters:
        if key in node:
            yield from family(f"meshnode_{key}_total", "counter", text, [((), float(node[key]))])


def _peers(peers: list[Mapping[str, Any]]) -> Iterable[str]:
    counts = {state: 0.0 for state in PEER_STATES}
    for peer in peers:
        counts[str(peer.get("state"))] = counts.get(str(peer.get("state")), 0.0) + 1
    yield from family("meshnode_peers", "gauge", "Known peers by membership state.",
                      [((("state", s),), n) for s, n in counts.items()])  # fmt: skip
    up: list[Sample] = []
    rtt: list[Sample] = []
    seen: list[Sample] = []
    for peer in peers:
        labels: Labels = (("peer", str(peer.get("node_id"))),)
        alive = peer.get("state") == "alive" and bool(peer.get("connected"))
        up.append((labels, float(alive)))
        if peer.get("rtt_ms") is not None:
            rtt.append((labels, float(peer["rtt_ms"]) / 1e3))
        if peer.get("last_seen_s_ago") is not None:
            seen.append((labels, float(peer["last_seen_s_ago"])))
    yield from family("meshnode_peer_up", "gauge",
                      "1 while the peer is alive and connected, else 0.", up)  # fmt: skip
    yield from family("meshnode_peer_rtt_seconds", "gauge", "Heartbeat round trip.", rtt)
    yield from family("meshnode_peer_last_seen_seconds", "gauge",
                      "Seconds since the last frame from the peer.", seen)  # fmt: skip


def _layers(layers: Any) -> str:
    # Inclusive, as `meshnode status` prints them: [0, 10) is 0-9.
    if isinstance(layers, list | tuple) and len(layers) == 2:
        return f"{layers[0]}-{int(layers[1]) - 1}"
    return ""


def _stages(
    host: Mapping[str, Any] | None, run: Mapping[str, Any] | None, node_id: str
) -> Iterable[str]:
    samples: list[Sample] = []
    for stage in (host or {}).get("stages", []):
        labels = (("node_id", str(stage.get("node_id"))), ("layers", _layers(stage.get("layers"))))
        samples.append((labels, float(stage.get("state") == "ready")))
    if run is not None:
        labels = (("node_id", node_id), ("layers", _layers(run.get("layers"))))
        samples.append((labels, float(run.get("state") == "ready")))
    yield from family("meshnode_stage_ready", "gauge",
                      "1 for a stage that is loaded and serving, else 0.", samples)  # fmt: skip


def _kv(usages: list[tuple[str, Mapping[str, Any]]]) -> Iterable[str]:
    fields = [
        ("sequences", "Sequences holding a KV cache on this node's stage."),
        ("max_sequences", "Sequences this node's stage can hold at once."),
        ("used_tokens", "Positions held in this node's KV caches."),
        ("capacity_tokens", "Positions this node's KV caches can hold (all sequences)."),
    ]
    for key, text in fields:
        samples = [((("role", role),), float(usage[key])) for role, usage in usages]
        yield from family(f"meshnode_kv_cache_{key}", "gauge", text, samples)
    ratio = [
        ((("role", role),), float(u["used_tokens"]) / max(1, int(u["capacity_tokens"])))
        for role, u in usages
    ]
    yield from family("meshnode_kv_cache_usage_ratio", "gauge",
                      "Used over capacity positions of this node's KV caches.", ratio)  # fmt: skip
    yield from _prefix([(role, u) for role, u in usages if "prefix_hit_tokens" in u])


def _prefix(usages: list[tuple[str, Mapping[str, Any]]]) -> Iterable[str]:
    """The stage's prefix cache (issue 30): its blocks by state, or a hybrid stage's
    snapshots, and its counters."""
    if not usages:
        return
    yield from _prefix_hits(usages)
    snapshots = [(role, u) for role, u in usages if "prefix_snapshots" in u]
    if snapshots:
        yield from _prefix_snapshots(snapshots)
    usages = [(role, u) for role, u in usages if "prefix_blocks_total" in u]
    if not usages:
        return
    states = ("used", "cached", "free")
    blocks = [
        ((("role", role), ("state", state)), float(u[f"prefix_blocks_{state}"]))
        for role, u in usages
        for state in states
    ]
    yield from family("meshnode_prefix_cache_blocks", "gauge",
                      "Prefix-cache blocks in use by sequences, cached for reuse, or free.",
                      blocks)  # fmt: skip
    text = "Prefix-cache blocks evicted to make room (least recently used)."
    samples = [((("role", role),), float(u["prefix_evicted_blocks"])) for role, u in usages]
    yield from family("meshnode_prefix_cache_evicted_blocks_total", "counter", text, samples)


def _prefix_hits(usages: list[tuple[str, Mapping[str, Any]]]) -> Iterable[str]:
    counters = [
        ("hit_tokens", "Prompt positions copied from the prefix cache instead of computed."),
        ("miss_tokens", "Prompt positions computed (prefill rows of new sequences)."),
    ]
    for key, text in counters:
        samples = [((("role", role),), float(u[f"prefix_{key}"])) for role, u in usages]
        yield from family(f"meshnode_prefix_cache_{key}_total", "counter", text, samples)


def _prefix_snapshots(usages: list[tuple[str, Mapping[str, Any]]]) -> Iterable[str]:
    """A hybrid stage's recurrent-state snapshots of cached prefixes."""
    gauges = [
        ("snapshots", "Recurrent-state snapshots of cached prefixes a hybrid stage keeps."),
        ("snapshot_bytes", "Bytes of a hybrid stage's prefix snapshots."),
    ]
    for key, text in gauges:
        samples = [((("role", role),), float(u[f"prefix_{key}"])) for role, u in usages]
        yield from family(f"meshnode_prefix_cache_{key}", "gauge", text, samples)
    text = "Prefix snapshots evicted to make room (least recently used)."
    samples = [((("role", role),), float(u["prefix_evicted_snapshots"])) for role, u in usages]
    yield from family("meshnode_prefix_cache_evicted_snapshots_total", "counter", text, samples)


def request_histogram() -> Histogram:
    """The histogram :class:`RequestTimer` fills."""
    return Histogram(
        "meshnode_http_request_duration_seconds",
        "HTTP requests from first byte in to last byte out, by route, method and status.",
        buckets=REQUEST_BUCKETS_S,
    )


class RequestTimer:
    """ASGI middleware: each HTTP request's duration into :attr:`histogram`."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = trio.current_time()
        status = 0  # no response started: the client left first

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", UNMATCHED_ROUTE)  # a route's template: bounded
            self.histogram.observe(
                trio.current_time() - started,
                method=method_label(scope.get("method")),
                route=str(path),
                status=str(status) if 0 <= status <= 599 else OTHER_LABEL,
            )


def method_label(method: object) -> str:
    """``method`` if it is one of :data:`KNOWN_METHODS`, else :data:`OTHER_LABEL`."""
    return method if isinstance(method, str) and method in KNOWN_METHODS else OTHER_LABEL
