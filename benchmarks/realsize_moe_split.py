"""The Qwen3-30B-A3B shape split across three ``meshnode join`` processes on this machine,
each offering less memory than the whole model (issue 31's "split below memory").

Run: ``.venv/bin/python benchmarks/realsize_moe_split.py [--layers 12] [--dtype native]
[--tokens 32] [--rounds 3] [--share 0.45]``

The model is ``benchmarks/realsize_moe.py``'s random-weight GGUF of the real shape (Q4_K_M
mix, 128 experts of ffn 768, top 8), cut to its first ``--layers`` layers (all 48 are
~19 GB: ``--layers 48`` where the disk and memory allow). Three nodes start on loopback,
each with ``--max-memory`` at ``--share`` of the file's bytes (below the whole model, so
no node can hold it alone; three together can), ``--split 3``, one kernel thread each
(the stages of one sequence run one after another), speculation off, float32 activations
on the wire. Then, per round, greedy completions of a 16-token prompt through
``/v1/completions`` (``return_token_ids``):

- the tokens must equal one node's: the same file and mode in this process
  (:class:`benchmarks.engine.MeshnodeRunner`, the whole model mapped), else it exits 1;
- decode tokens/s: ``--tokens`` more tokens, ``tokens / (t(1 + tokens) - t(1))`` from two
  requests of the same prompt (the prefill and the first token cancel out), median over
  rounds.

Printed: the plan (each stage's layers and its node's cap), the rates, the one-node rate
of the same process, and the load average before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import MeshnodeRunner, uptime
from benchmarks.realsize_moe_gguf import cached_gguf
from tests.e2e.cluster import (
    HEARTBEAT_ENV,
    SINGLE_THREAD_ENV,
    Cluster,
    init_token,
    ready_stages,
    wait_for,
)

SHAPE = "qwen3-30b-a3b"
PROMPT = 16
CONTEXT = 256
READY_TIMEOUT_S = 900.0  # three processes map and check a multi-GB file on shared cores
REQUEST_TIMEOUT_S = 600.0


def prompt_ids() -> list[int]:
    return [int(i) for i in np.random.default_rng(1).integers(100, 40000, PROMPT)]


def complete(http: httpx.Client, api: str, model: str, n: int) -> tuple[list[int], float]:
    """Greedy token ids of ``n`` new tokens after the prompt, and the request's seconds."""
    body = {
        "model": model,
        "prompt": prompt_ids(),
        "temperature": 0,
        "max_tokens": n,
        "return_token_ids": True,
    }
    began = time.perf_counter()
    reply = http.post(f"{api}/v1/completions", json=body)
    seconds = time.perf_counter() - began
    reply.raise_for_status()
    choice: dict[str, Any] = reply.json()["choices"][0]
    return [int(t) for t in choice["token_ids"]], seconds


def one_node(model: Path, dtype: str, tokens: int) -> tuple[list[int], float]:
    """One node's greedy tokens (this process, the whole model) and its decode tokens/s."""
    runner = MeshnodeRunner(str(model), {"native": "blocks"}.get(dtype, dtype), 1)
    runner.generate(prompt_ids(), 2)  # warm-up
    _, decode_s, out = runner.generate(prompt_ids(), tokens + 1)
    return out, tokens / decode_s


def start_split(cluster: Cluster, root: Path, model: Path, args: argparse.Namespace) -> Any:
    cap = int(model.stat().st_size * args.share)
    common = ("--max-memory", str(cap), "--threads", "1", "--dtype", args.dtype)
    token = init_token(root / "mesh.token")
    workers = [
        cluster.spawn(f"w{i}", token, *common, "--local-model", str(model), mdns=False)
        for i in range(2)
    ]
    cluster.wait_started(*workers)
    peers = [a for w in workers for a in ("--peer", w.listen)]
    host = cluster.spawn(
        "host", token, *peers, *common,
        "--model", str(model),
        "--split", "3",
        "--context", str(CONTEXT),
        "--wire-dtype", "f32",
        "--speculative", "off",
        mdns=False,
    )  # fmt: skip
    cluster.wait_started(host)
    wait_for(lambda: ready_stages(host) == 3, READY_TIMEOUT_S, "3 ready stages")
    stages = host.status()["host"]["stages"]
    size = model.stat().st_size
    print(f"each node --max-memory {cap / 2**30:.2f} GiB, the model {size / 2**30:.2f} GiB")
    for s in stages:
        a, b = s["layers"]
        print(f"  layers {a}..{b - 1} on {s['node_id']}: {s['memory_bytes'] / 2**30:.2f} GiB")
    return host


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12, help="the model's first N layers")
    parser.add_argument("--dtype", default="native", choices=["native", "q8"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--share", type=float, default=0.45, help="each node's cap / file")
    args = parser.parse_args()
    if not 1 / 3 < args.share < 1:
        parser.error("--share must be below 1 (below the model) and above 1/3 (three hold it)")
    model = cached_gguf(SHAPE, args.layers)
    print(f"{model.name}, --dtype {args.dtype}: start {uptime()}", flush=True)
    want, alone = one_node(model, args.dtype, args.tokens)
    env = {**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp), env=env) as cluster:
        try:
            host = start_split(cluster, Path(tmp), model, args)
        except AssertionError as exc:
            raise SystemExit(f"{exc}\n{cluster.logs()}") from exc
        rates = []
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            name = http.get(f"{host.api}/v1/models").json()["data"][0]["id"]
            complete(http, host.api, name, 2)  # warm-up
            for r in range(args.rounds):
                _, first = complete(http, host.api, name, 1)
                got, whole = complete(http, host.api, name, args.tokens + 1)
                if got != want:
                    raise SystemExit(f"round {r + 1}: split tokens {got} != one node's {want}")
                rates.append(args.tokens / (whole - first))
                print(f"round {r + 1}: {rates[-1]:.2f} tok/s, same tokens as one node", flush=True)
    print(f"end {uptime()}")
    print(f"\n| {model.name} | --dtype | decode tok/s |")
    print("|---|---|---:|")
    print(f"| 3 nodes, each --max-memory {args.share:.2f} of the model | {args.dtype} | "
          f"{statistics.median(rates):.2f} |")  # fmt: skip
    print(f"| one node (this process) | {args.dtype} | {alone:.2f} |")


if __name__ == "__main__":
    main()
