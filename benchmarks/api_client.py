"""The ``--api`` client of benchmarks/concurrency.py, run as a process of its own (a
client on this machine competes for its cores, as a real one would): ``S`` streaming
``/v1/completions`` at once, the prompts as a JSON list on stdin; prints the completion
tokens the usage chunks report and the seconds all streams took.

argv: url, model, streams, max tokens, temperature, top_p.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

url, model, streams, tokens, temperature, top_p = sys.argv[1:7]
prompts = json.loads(sys.stdin.read())


async def one(client: httpx.AsyncClient, i: int) -> int:
    body = {
        "model": model,
        "prompt": prompts[i % len(prompts)],
        "max_tokens": int(tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    used: int = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                used = json.loads(line[6:])["usage"]["completion_tokens"]
    return used


async def main() -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        began = time.perf_counter()
        used = await asyncio.gather(*(one(client, i) for i in range(int(streams))))
        print(sum(used), time.perf_counter() - began)


asyncio.run(main())
