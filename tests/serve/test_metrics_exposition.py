"""``/metrics`` parsed with Prometheus' own parser (``prometheus_client``): the names and
types of every family, request latency, and node, peer, stage and KV health from a status
body (the e2e split test checks the same on a live host and its workers)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from meshnode.serve.node_metrics import status_metrics
from tests.serve.conftest import TINY_MODEL_ID, Server

REQUEST_TIMEOUT_S = 30.0

#: Every family the host exports with its type (counters by their name without _total,
#: as the parser names them).
HOST_FAMILIES = {
    "meshnode_node_info": "gauge",
    "meshnode_peers": "gauge",
    "meshnode_peer_up": "gauge",
    "meshnode_stage_ready": "gauge",
    "meshnode_http_request_duration_seconds": "histogram",
    "meshnode_requests": "counter",
    "meshnode_prompt_tokens": "counter",
    "meshnode_generation_tokens": "counter",
    "meshnode_requests_in_flight": "gauge",
    "meshnode_requests_waiting": "gauge",
    "meshnode_time_to_first_token_seconds": "histogram",
    "meshnode_time_per_output_token_seconds": "histogram",
    "meshnode_stage_compute_seconds": "histogram",
    "meshnode_wire_seconds": "histogram",
    "meshnode_stage_seconds": "counter",
    "meshnode_spec_accept_rate": "gauge",
}


def parse(text: str) -> dict[str, Metric]:
    """The families of an exposition; fails on a family named twice."""
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    return {f.name: f for f in families}


def value(family: Metric, suffix: str = "", **labels: str) -> float:
    """The one sample of ``family`` (name + ``suffix``) whose labels include ``labels``."""
    found = [
        s.value for s in family.samples
        if s.name == family.name + suffix and labels.items() <= s.labels.items()
    ]  # fmt: skip
    assert len(found) == 1, (family.name, suffix, labels, family.samples)
    return found[0]


async def test_the_hosts_metrics_parse_with_their_types_and_time_each_request(
    server: Server,
) -> None:
    api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    async with api, httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        await api.chat.completions.create(
            model=TINY_MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        await api.completions.create(model=TINY_MODEL_ID, prompt="Hi", max_tokens=3)
        await http.get(server.base_url + "/no/such/path")
        families = parse((await http.get(server.base_url + "/metrics")).text)
    for name, kind in HOST_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    latency = families["meshnode_http_request_duration_seconds"]
    chat = {"route": "/v1/chat/completions", "method": "POST", "status": "200"}
    assert value(latency, "_count", **chat) == 1
    assert value(latency, "_bucket", le="+Inf", **chat) == 1
    assert value(latency, "_sum", **chat) > 0
    assert value(latency, "_count", route="/v1/completions", status="200") == 1
    assert value(latency, "_count", route="unmatched", status="404") == 1
    assert value(families["meshnode_requests"], "_total", endpoint="chat", outcome="ok") == 1
    assert value(families["meshnode_time_to_first_token_seconds"], "_count") == 2


HOST_STATUS: dict[str, Any] = {
    "node": {"node_id": "aaaa", "mesh_name": "home", "device": "cpu", "protocol_version": 1,
             "uptime_s": 12.5, "usable_memory": 8 << 30, "refused_handshakes": 2,
             "protocol_errors": 0, "internal_errors": 0},
    "peers": [
        {"node_id": "bbbb", "state": "alive", "connected": True, "rtt_ms": 1.5,
         "last_seen_s_ago": 0.2},
        {"node_id": "cccc", "state": "suspect", "connected": True, "rtt_ms": None,
         "last_seen_s_ago": 4.0},
    ],
    "host": {
        "state": "ready",
        "stages": [
            {"node_id": "aaaa", "layers": [0, 10], "state": "ready"},
            {"node_id": "bbbb", "layers": [10, 30], "state": "loading"},
        ],
        "kv": {"sequences": 2, "max_sequences": 8, "used_tokens": 512,
               "capacity_tokens": 8 * 2048},
    },
}  # fmt: skip
WORKER_STATUS: dict[str, Any] = {
    "node": {"node_id": "bbbb"},
    "peers": [{"node_id": "aaaa", "state": "alive", "connected": False}],
    "run": {"state": "ready", "layers": [10, 30],
            "kv": {"sequences": 0, "max_sequences": 8, "used_tokens": 0,
                   "capacity_tokens": 16384}},
}  # fmt: skip


def test_node_peer_stage_and_kv_health_from_a_hosts_status() -> None:
    families = parse("\n".join(status_metrics(HOST_STATUS)) + "\n")
    assert value(families["meshnode_node_info"], node_id="aaaa", mesh_name="home") == 1
    assert value(families["meshnode_node_uptime_seconds"]) == 12.5
    assert value(families["meshnode_refused_handshakes"], "_total") == 2
    peers = families["meshnode_peers"]
    assert [value(peers, state=s) for s in ("alive", "suspect", "dead")] == [1, 1, 0]
    assert value(families["meshnode_peer_up"], peer="bbbb") == 1
    assert value(families["meshnode_peer_up"], peer="cccc") == 0
    assert value(families["meshnode_peer_rtt_seconds"], peer="bbbb") == 0.0015
    assert value(families["meshnode_peer_last_seen_seconds"], peer="cccc") == 4.0
    stages = families["meshnode_stage_ready"]
    assert value(stages, node_id="aaaa", layers="0-9") == 1
    assert value(stages, node_id="bbbb", layers="10-29") == 0
    state = families["meshnode_mesh_state"]
    assert value(state, state="ready") == 1
    assert sum(s.value for s in state.samples) == 1
    assert value(families["meshnode_kv_cache_used_tokens"], role="host") == 512
    assert value(families["meshnode_kv_cache_usage_ratio"], role="host") == 512 / 16384


def test_a_worker_reports_its_own_stage_and_kv() -> None:
    families = parse("\n".join(status_metrics(WORKER_STATUS)) + "\n")
    assert value(families["meshnode_stage_ready"], node_id="bbbb", layers="10-29") == 1
    assert value(families["meshnode_kv_cache_capacity_tokens"], role="worker") == 16384
    assert value(families["meshnode_kv_cache_usage_ratio"], role="worker") == 0
    assert value(families["meshnode_peer_up"], peer="aaaa") == 0  # alive but not connected
    assert "meshnode_mesh_state" not in families
