"""The prefix cache as a client sees it (issue 30): usage reports the prompt tokens read
from the cache (OpenAI ``prompt_tokens_details.cached_tokens``, Anthropic
``cache_read_input_tokens``), ``cache_prompt: false`` opts out, and ``/metrics`` counts
them; the reply is the same either way."""

from __future__ import annotations

from typing import Any

import httpx

from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS
from meshnode.serve.node_metrics import status_metrics
from tests.serve.conftest import TINY_MODEL_ID, Server

LONG = " ".join(f"word{i}" for i in range(60))  # several blocks of the tiny model's context
TIMEOUT_S = 120.0


async def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        reply = await http.post(f"{server.base_url}{path}", json=body)
    assert reply.status_code == 200, reply.text
    out: dict[str, Any] = reply.json()
    return out


async def test_openai_usage_reports_cached_tokens_and_cache_prompt_opts_out(
    server: Server,
) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 6,
        "temperature": 0,
    }
    first = await _post(server, "/v1/chat/completions", body)
    second = await _post(server, "/v1/chat/completions", body)
    opted_out = await _post(server, "/v1/chat/completions", {**body, "cache_prompt": False})
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
    assert cached > 0
    assert opted_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    texts = {r["choices"][0]["message"]["content"] for r in (first, second, opted_out)}
    assert len(texts) == 1
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        metrics = (await http.get(f"{server.base_url}/metrics")).text
    assert f"meshnode_prompt_cached_tokens_total {cached}" in metrics


async def test_anthropic_usage_counts_cache_reads_apart(server: Server) -> None:
    body = {
        "model": TINY_MODEL_ID,
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": LONG}],
    }
    first = (await _post(server, "/v1/messages", body))["usage"]
    second = (await _post(server, "/v1/messages", body))["usage"]
    opted_out = (await _post(server, "/v1/messages", {**body, "cache_prompt": False}))["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] > 0
    # As Anthropic counts: input_tokens are the prompt tokens not read from the cache.
    total = first["input_tokens"]
    assert second["input_tokens"] + second["cache_read_input_tokens"] == total
    assert opted_out == first


def test_node_metrics_show_the_prefix_pool() -> None:
    kv = {
        "sequences": 1,
        "max_sequences": 8,
        "used_tokens": 40,
        "capacity_tokens": 2048,
        "prefix_blocks_used": 2,
        "prefix_blocks_cached": 3,
        "prefix_blocks_free": 11,
        "prefix_blocks_total": 16,
        "prefix_block_tokens": 32,
        "prefix_hit_tokens": 64,
        "prefix_miss_tokens": 100,
        "prefix_evicted_blocks": 0,
        "prefix_bytes": 1 << 20,
    }
    lines = list(status_metrics({"run": {"kv": kv}}))
    assert 'meshnode_prefix_cache_blocks{role="worker",state="used"} 2' in lines
    assert 'meshnode_prefix_cache_blocks{role="worker",state="free"} 11' in lines
    assert 'meshnode_prefix_cache_hit_tokens_total{role="worker"} 64' in lines
    assert 'meshnode_prefix_cache_miss_tokens_total{role="worker"} 100' in lines
    plain = {k: v for k, v in kv.items() if not k.startswith("prefix_")}
    assert not any("prefix" in line for line in status_metrics({"run": {"kv": plain}}))
