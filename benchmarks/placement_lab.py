"""Placement by measured speed, in the lab (issue 34): memory-weighted against measured.

Run (root, iproute2, cgroup v1 ``cpu`` mounted at /sys/fs/cgroup/cpu)::

    .venv/bin/python benchmarks/placement_lab.py [--model smollm2|1b|8b] [--tokens 64]
        [--rounds 3] [--quota 100 100 30] [--max-memory 2GiB] [--placements memory speed]
        [--split 3] [--slow-link RATE | --slow-pair RATE]

Three ``meshnode join`` processes, each in its own network namespace on one bridge
(:class:`tests.lab.netlab.NetLab`), each in a cgroup v1 ``cpu`` group with a CFS quota of
``--quota`` percent of one core (default 100, 100 and 30: the third node is throttled) and
one BLAS thread, all with the same ``--max-memory``. For each ``--placements`` value a fresh
mesh serves the model with ``--split 3 --placement P``; once it is ready (with ``speed``:
calibrated and re-placed before the API opens), ``--rounds`` greedy completions of
``--tokens`` tokens are timed one at a time after a warm-up. Printed per placement: each
stage's node, layers and measured decode rate (weight bytes a second), decode tokens/s
(median of the rounds) and the ratio to the first placement, and whether the tokens are the
same.

``--model``: ``smollm2`` (SmolLM2-135M, the wheel's GGUF), ``1b`` / ``8b`` (the random-weight
real-size shapes of ``benchmarks/realsize_gguf.py``, written into its cache folder if
absent; the 8B file is 4.4 GB). With ``--max-memory`` adding up to less than the file (e.g.
``--model 8b --max-memory 900MiB --kv-dtype f16`` for 0.6x of it over three nodes; KV of
8 sequences of 512 tokens must still fit in memory) the mesh serves from
disk (``offload_bytes`` per stage is printed); the token ids' digest printed at the end is
compared with one node's (``--single``: one node, ``--single-memory`` 8GiB, the whole model
in memory). ``--from-disk`` runs both in one command: the mesh with each node's
``--max-memory`` 0.2x the file (0.6x over three), quotas 100/100/100, f16 KV, by speed,
then one node, and says whether the tokens are the same. Every run prints each node's own
measurement (µs per layer a token at decode, 8 rows and prefill; its disk read rate).

One command each (issue 34)::

    .venv/bin/python benchmarks/placement_lab.py --model smollm2
    .venv/bin/python benchmarks/placement_lab.py --model 1b
    .venv/bin/python benchmarks/placement_lab.py --model 8b --from-disk
    .venv/bin/python benchmarks/placement_lab.py --quota 100 100 100 --slow-link 2mbit --split 2
    .venv/bin/python benchmarks/placement_lab.py --slow-pair 512kbit --placements speed

``--slow-link RATE`` shapes w2's link both ways with ``tc tbf`` before the nodes start, so
each node's link probe measures it (``meshnode.node.links``); with ``--split 2`` and equal
quotas the plan should put stage 1 on w1 (the quicker hop). ``--slow-pair RATE`` shapes
only the link between w1 and w2 (``NetLab.shape_pair``: a ``u32`` filter on w2's address
on w1's veth, a ``tbf`` under it; w1's and w2's other links are not shaped) and adds a
third worker, w3, offering 3/4 of the others' ``--max-memory`` (quotas 100 each unless
``--quota`` gives four): a memory plan over all four is host, w1, w2 (neighbours over the
shaped link; the host plans as soon as three nodes are up, with those); by speed,
calibrated and re-placed, it should keep w1 and w2 apart (host, w1, w3 or host, w2, w3
...) once the workers have reported their link; the run prints whether they are
neighbours. At 512 kbit/s a SmolLM2 token's f32
activations take 36 ms over that link, longer than a stage's compute, and the links'
256 KiB probe 4 s (a probe not answered in 10 s leaves the link unmeasured). Each stage's
measured link (MB/s) and hop time (from the node before) are printed.
Targets (issue 34): the throttled node gets about a third of the others' layers, and decode
with ``speed`` is at least 1.3x ``memory``'s. Numbers on a shared machine are noisy: run it
on an idle one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshnode.node.parsers import parse_bytes
from tests.e2e.cluster import (
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    wait_for,
    wait_started,
)
from tests.lab.netlab import LabHost, NetLab, unavailable_reason

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
# The CFS period of a node's group: the shortest whose quota the kernel takes (a quota of at
# least 1 ms), so the quota slows the node at any duty: with a 100 ms period a pipeline stage
# that computes a few ms a token and waits for the others the rest of the time stays under
# a 30 % quota and runs at full speed (measured 2026-11-29: the 1B shape's throttled node
# read its weights at 0.45x the others' rate instead of 0.3x, and faster the fewer layers
# it held, which no fixed rate a plan counts on can describe). 30 %: 1 ms of every 3.3 ms.
MIN_QUOTA_US = 1_000


def period_us(percent: int) -> int:
    """The CFS period for a quota of ``percent`` % of one core."""
    return max(MIN_QUOTA_US, -(-MIN_QUOTA_US * 100 // percent))


MESH_PORT = 7470
START_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 900.0  # three stages of the 8B shape, read from a cold disk
REQUEST_TIMEOUT_S = 900.0
HEARTBEAT_ENV = {"MESHNODE_HEARTBEAT_S": "0.5", "MESHNODE_SUSPECT_S": "6", "MESHNODE_DEAD_S": "15"}
PROMPT = "The history of the printing press begins"
NAMES = ("host", "w1", "w2")
PAIR_NAMES = (*NAMES, "w3")  # --slow-pair: a third worker, so that another order exists


def model_path(name: str) -> tuple[str, Path | None]:
    """``--model`` for the host, and the file the workers must be allowed to open."""
    if name == "smollm2":
        return "smollm2-135m", None
    from benchmarks.realsize_gguf import cached_gguf

    path = cached_gguf(name, "q4_k_m")
    return str(path), path


@contextlib.contextmanager
def cpu_group(name: str, percent: int) -> Iterator[Path]:
    """A cgroup v1 ``cpu`` group of ``percent`` % of one core; removed on exit (its
    processes back in the root group first)."""
    group = CPU_CGROUP / f"meshnode-bench-{os.getpid()}-{name}"
    group.mkdir()
    try:
        period = period_us(percent)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(period * percent // 100))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
        group.rmdir()


def node_memory(name: str, args: Any, *, single: bool) -> str:
    """A node's ``--max-memory``: w3 (``--slow-pair``) offers 3/4 of the others', so that
    by memory the plan takes w1 and w2, neighbours over the shaped link."""
    if single:
        return str(args.single_memory)
    if name == "w3":
        return f"{parse_bytes(args.max_memory) * 3 // 4 >> 20}MiB"
    return str(args.max_memory)


def status_host(node: Node) -> dict[str, Any]:
    block: dict[str, Any] = node.status().get("host") or {}
    return block


def placed(node: Node, count: int) -> bool:
    """``count`` ready stages, and with placement by speed the calibration done."""
    host = status_host(node)
    stages = host.get("stages") or []
    ready = host.get("state") == "ready" and len(stages) == count
    return ready and all(s["state"] == "ready" for s in stages) and host.get("calibration") != ""


def complete(host: LabHost, node: Node, tokens: int) -> tuple[float, str]:
    """One greedy completion: (seconds a generated token, its token ids as text). Ids, not
    text: the real-size shapes' random weights pick tokens that decode to nothing."""
    model = status_host(node).get("model_id")
    body = {
        "model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": tokens,
        "return_token_ids": True,
    }  # fmt: skip
    began = time.perf_counter()
    reply = host.post(f"{node.api}/v1/completions", body, REQUEST_TIMEOUT_S)
    seconds = time.perf_counter() - began
    reply.raise_for_status()
    ids = reply.json()["choices"][0]["token_ids"]
    return seconds / max(len(ids), 1), " ".join(map(str, ids))


def run_mesh(
    lab: NetLab, hosts: dict[str, LabHost], placement: str, args: Any, *, single: bool = False
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"placement-{placement}-"))
    token = init_token(root / "mesh.token", name="bench")
    model, local = model_path(args.model)
    allow = ["--local-model", str(local)] if local else []
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(Cluster(root, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}))
        groups = {
            n: stack.enter_context(cpu_group(n, q))
            for n, q in zip(args.names, args.quota, strict=True)
        }
        nodes: dict[str, Node] = {}

        def spawn(name: str, *extra: str) -> Node:
            host = hosts[name]
            node = cluster.spawn(
                name, token, "--max-memory", node_memory(name, args, single=single), *extra,
                mdns=False, listen=f"0.0.0.0:{MESH_PORT}",
                interface=None, prefix=host.command(), get=host.get,
            )  # fmt: skip
            (groups[name] / "cgroup.procs").write_text(str(node.process.pid))
            nodes[name] = node
            return node

        workers = [spawn(w, *allow) for w in args.names[1:]]
        wait_started(*workers, timeout_s=START_TIMEOUT_S)
        peers = [f for w in args.names[1:] for f in ("--peer", f"{hosts[w].address}:{MESH_PORT}")]
        split = ["--split", "1"] if single else ["--split", str(args.split)]
        host_node = spawn(
            "host", *peers, "--model", model, *split, "--placement", placement,
            "--context", "512", "--speculative", "off", "--kv-dtype", args.kv_dtype,
            "--wire-dtype", "f32",  # activations exact between stages: one node's tokens
        )  # fmt: skip

        def ready() -> bool:
            return _single_ready(host_node) if single else placed(host_node, args.split)

        wait_for(ready, READY_TIMEOUT_S, f"the mesh placed by {placement}")
        complete(hosts["host"], host_node, 8)  # warm-up
        rounds = [complete(hosts["host"], host_node, args.tokens) for _ in range(args.rounds)]
        host = status_host(host_node)
        names = {nodes[n].node_id(): n for n in args.names}
    seconds = statistics.median(s for s, _ in rounds)  # a token
    return {
        "placement": "one node" if single else placement,
        "stages": [
            (
                names.get(s["node_id"], s["node_id"]),
                s["layers"],
                s.get("offload_bytes", 0),
                s.get("decode_bytes_per_s") or 0,
                s.get("link_mbytes_per_s"),
                s.get("hop_ms"),
                names.get(s.get("hop_from", ""), s.get("hop_from")),
            )
            for s in host["stages"]
        ],
        "measured": {
            names.get(s["node_id"], s["node_id"]): s.get("self_measured") or {}
            for s in host["stages"]
        },
        "placed_by": host.get("placed_by"),
        "calibration": host.get("calibration"),
        "tokens_per_s": 1.0 / seconds,
        "texts": {text for _, text in rounds},
    }


def _single_ready(node: Node) -> bool:
    host = status_host(node)
    stages = host.get("stages") or []
    return host.get("state") == "ready" and all(s["state"] == "ready" for s in stages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "1b", "8b"), default="smollm2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quota", type=int, nargs="+", help="%% of a core per node (host, w1, w2[, w3]); "
        "default 100 100 30, or 100 each with --from-disk or --slow-pair",
    )  # fmt: skip
    parser.add_argument("--max-memory", default="2GiB")
    parser.add_argument("--placements", nargs="+", default=["memory", "speed"])
    parser.add_argument("--single", action="store_true", help="one stage (--split 1) only")
    parser.add_argument(
        "--from-disk",
        action="store_true",
        help="the mesh short of memory: --max-memory of each node 0.2x the model file "
        "(0.6x over three), quotas 100 100 100, f16 KV, placed by speed; then one node "
        "with the whole model in memory (--single-memory): same tokens, decode and disk",
    )
    parser.add_argument("--single-memory", default="8GiB", help="the one node's --max-memory")
    parser.add_argument("--kv-dtype", default="auto", help="the host's --kv-dtype (f16 halves KV)")
    parser.add_argument("--split", type=int, default=3, help="stages of the mesh (2 or 3)")
    shaping = parser.add_mutually_exclusive_group()
    shaping.add_argument("--slow-link", help="shape w2's link to this tc rate (e.g. 2mbit)")
    shaping.add_argument(
        "--slow-pair", help="add w3 and shape only the w1-w2 link to this tc rate (512kbit)"
    )
    args = parser.parse_args()
    args.names = PAIR_NAMES if args.slow_pair else NAMES
    default_quota = [100] * len(args.names) if args.slow_pair else [100, 100, 30]
    if args.from_disk:
        _, local = model_path(args.model)
        size = local.stat().st_size if local else 0
        args.max_memory = f"{max(size // 5 >> 20, 64)}MiB"
        default_quota, args.kv_dtype, args.placements = [100, 100, 100], "f16", ["speed"]
    args.quota = args.quota or default_quota
    if len(args.quota) != len(args.names):
        parser.error(f"--quota needs {len(args.names)} values ({', '.join(args.names)})")
    reason = unavailable_reason()
    if reason is not None or not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        print(f"placement_lab: needs root, iproute2 and cgroup v1 cpu ({reason})")
        return 2
    print(f"model {args.model}, quotas {args.quota} %, --max-memory {args.max_memory} each")
    print(f"load average before: {os.getloadavg()}")
    results = []
    with NetLab() as lab:
        hosts = {name: lab.add_host(name) for name in args.names}
        if args.slow_link:
            lab.rate_limit(hosts["w2"], args.slow_link, burst="16kb", latency="400ms")
        if args.slow_pair:
            lab.shape_pair(hosts["w1"], hosts["w2"], args.slow_pair, burst="16kb", latency="400ms")
        for placement in [] if args.single else args.placements:
            results.append(run_mesh(lab, hosts, placement, args))
        if args.single or args.from_disk:
            results.append(run_mesh(lab, hosts, "speed", args, single=True))
    first = results[0]["tokens_per_s"]
    for r in results:
        stages = ", ".join(
            f"{n} [{a}:{b}) {rate / 1e6:.0f} MB/s"
            + (f" {o / 2**20:.0f} MiB from disk" if o else "")
            + (f" hop {hop} ms from {before} (link {link} MB/s)" if hop is not None else "")
            for n, (a, b), o, rate, link, hop, before in r["stages"]
        )
        print(
            f"{r['placement']:>7}: {r['tokens_per_s']:.2f} tok/s ({r['tokens_per_s'] / first:.2f}x)"
            f"  placed by {r['placed_by']} (calibration: {r['calibration']})  {stages}"
        )
        for node, claim in r["measured"].items():
            print(f"         {node} measured itself: {claim}")
        if args.slow_pair:
            order = [stage[0] for stage in r["stages"]]
            apart = all({x, y} != {"w1", "w2"} for x, y in itertools.pairwise(order))
            print(f"         w1 and w2 (the shaped pair) neighbours: {not apart}")
    texts = [r["texts"] for r in results]
    same = all(len(t) == 1 for t in texts) and len(set().union(*texts)) == 1
    print(f"same tokens in every round and placement: {same}")
    for r in results:  # to compare runs (one node against the mesh): the token ids' digest
        digests = sorted(hashlib.sha256(t.encode()).hexdigest()[:16] for t in r["texts"])
        print(f"{r['placement']:>7} token ids sha256: {' '.join(digests)}")
    print(f"load average after: {os.getloadavg()}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
