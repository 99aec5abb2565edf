"""A link's bandwidth measured across network namespaces (issue 34): one host's link shaped
with ``tc tbf`` to 2 Mbit/s, another left alone; the probe of ``meshnode.node.links``
(:mod:`tests.lab.link_peer`) tells them apart and finds the shaped one at its rate. Then
one link between two workers shaped alone (``NetLab.shape_pair``): the probes find it
slow both ways and both workers' links to a third fast, and the planner, given those
measurements as the workers' reported links, keeps the two from being neighbours. Last, a
live mesh over such a pair: the host introduces the workers to each other, they measure
their links as they prepare, and the calibration re-places the mesh before its API opens
so that the two are no neighbours.

Bounded: 256 KiB at 250 kB/s take a second; the processes' start (imports) is
what takes time, and each step waits for its process's own line, with a timeout."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnode.node.planner import NodeLink, plan
from tests.e2e.cluster import (
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    WaitTimeout,
    init_token,
    wait_for,
    wait_started,
)
from tests.lab.netlab import LabHost, NetLab, unavailable_reason
from tests.node.test_planner_links import CONTEXT, MODEL
from tests.node.test_planner_neighbours import node

pytestmark = [pytest.mark.lab, pytest.mark.timeout(300)]

PORT = 7481
# Slow enough that the unshaped link, measured by niced processes on a loaded 2-core box
# (2.7 MB/s at load 12: Python framing 256 KiB, not the veth), is still far faster.
SHAPED_RATE = "2mbit"
SHAPED_BYTES_S = 2_000_000 / 8
# Imports of a fresh process on a loaded 2-core box take seconds; a measure under a second.
PROCESS_TIMEOUT_S = 120.0
# The round trip given to the measured links: the probe measures rates, and a pair filter
# shapes the rate (a LAN's round trip, as the planner's tables use).
RTT_S = 0.001
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NetLab() as lab:
        yield lab


def _env() -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "protocol"), str(ROOT / "packaging")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _rate(measurer: LabHost, answerer: LabHost) -> float:
    """The rate ``measurer`` measures of its link to ``answerer``, in bytes a second."""
    module = [sys.executable, "-m", "tests.lab.link_peer"]
    with subprocess.Popen(
        answerer.command(*module, "answer", str(PORT)),
        stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    ) as server:  # fmt: skip
        try:
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "listening"
            done = subprocess.run(
                measurer.command(*module, "measure", answerer.address, str(PORT)),
                capture_output=True, text=True, env=_env(), cwd=ROOT,
                timeout=PROCESS_TIMEOUT_S, check=True,
            )  # fmt: skip
        finally:
            server.kill()
    return float(done.stdout.strip())


def test_a_shaped_link_is_measured_at_its_rate(lab: NetLab) -> None:
    answerer, shaped, free = lab.add_host("a"), lab.add_host("shaped"), lab.add_host("free")
    lab.rate_limit(shaped, SHAPED_RATE, burst="16kb", latency="400ms")
    slow = _rate(shaped, answerer)
    fast = _rate(free, answerer)
    # tbf lets a burst through at once and the TCP window ramps up: within a factor
    assert SHAPED_BYTES_S / 2 <= slow <= SHAPED_BYTES_S * 1.5, slow
    assert fast >= 4 * slow, (fast, slow)


@pytest.mark.timeout(600)  # eight fresh processes (imports) on a loaded 2-core box
def test_a_pair_filter_shapes_one_link_and_the_planner_keeps_its_ends_apart(
    lab: NetLab,
) -> None:
    a, b, c = lab.add_host("pa"), lab.add_host("pb"), lab.add_host("pc")
    lab.shape_pair(a, b, SHAPED_RATE, burst="16kb", latency="400ms")
    pairs = ((a, b), (b, a), (a, c), (b, c))
    measured = {(x.name, y.name): _rate(x, y) for x, y in pairs}
    slow = [measured["pa", "pb"], measured["pb", "pa"]]
    for shaped in slow:  # both ways: a's eth0 to b, a's bridge port from b
        assert SHAPED_BYTES_S / 2 <= shaped <= SHAPED_BYTES_S * 1.5, measured
    # a's and b's other links pass unshaped (--slow-link would have slowed a-c too)
    assert min(measured["pa", "pc"], measured["pb", "pc"]) >= 4 * max(slow), measured
    reported = {
        name: tuple(NodeLink(y, RTT_S, rate) for (x, y), rate in measured.items() if x == name)
        for name in ("pa", "pb", "pc")
    }
    for speed in (None, 1.0):  # placed by memory, then with every node measured alike
        blind = [node("h", 60, speed)] + [node(n, 60, speed) for n in reported]
        linked = [node("h", 60, speed)] + [
            node(n, 60, speed, *links) for n, links in reported.items()
        ]
        # Three stages are needed: by memory and id a and b are neighbours...
        assert plan(MODEL, blind, "h", CONTEXT).node_ids == ("h", "pa", "pb")
        # ...and with the links measured, c comes between them
        assert plan(MODEL, linked, "h", CONTEXT).node_ids == ("h", "pa", "pc"), measured


# The live mesh: a 512 kbit/s pair makes a SmolLM2 token's f32 activations (576 x 4 bytes)
# take 36 ms over it, longer than a stage's compute, and its 256 KiB probe 4 s.
PAIR_RATE = "512kbit"
MESH_PORT = 7470
MEMORY_MIB = 2048  # each node's --max-memory; the spare node offers 3/4 of it
HEARTBEAT_ENV = {"MESHNODE_HEARTBEAT_S": "0.5", "MESHNODE_SUSPECT_S": "6", "MESHNODE_DEAD_S": "15"}
# Four fresh processes import, prepare, compile kernels and calibrate on a loaded 2-core box.
READY_TIMEOUT_S = 600.0


def _placed(host: Node) -> list[str] | None:
    """The node ids of the host's stages once three serve and the calibration is done."""
    block = host.status().get("host") or {}
    stages = block.get("stages") or []
    done = block.get("state") == "ready" and block.get("calibration") not in (None, "")
    if not (done and len(stages) == 3 and all(s["state"] == "ready" for s in stages)):
        return None
    return [str(s["node_id"]) for s in stages]


@pytest.mark.timeout(900)
def test_a_live_mesh_keeps_the_ends_of_a_slow_link_apart(lab: NetLab, tmp_path: Path) -> None:
    """host, l1, l2 and l3 (3/4 of the others' memory) serve SmolLM2 in three stages by
    speed, the link between l1 and l2 shaped: by memory the plan is host, l1, l2 (or l2,
    l1), neighbours over the shaped link; the workers, introduced by the host's query,
    measure their links (and the spare l3 itself) while they prepare, and the calibration
    re-places the mesh before its API opens: l1 and l2 are no neighbours."""
    names = ("lh", "l1", "l2", "l3")
    hosts = {name: lab.add_host(name) for name in names}
    lab.shape_pair(hosts["l1"], hosts["l2"], PAIR_RATE, burst="16kb", latency="400ms")
    token = init_token(tmp_path / "mesh.token", name="links")
    with Cluster(tmp_path, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}) as cluster:

        def spawn(name: str, *extra: str) -> Node:
            memory = MEMORY_MIB * 3 // 4 if name == "l3" else MEMORY_MIB
            return cluster.spawn(
                name, token, "--max-memory", f"{memory}MiB", *extra, mdns=False,
                listen=f"0.0.0.0:{MESH_PORT}", interface=None,
                prefix=hosts[name].command(), get=hosts[name].get,
            )  # fmt: skip

        workers = {name: spawn(name) for name in names[1:]}
        wait_started(*workers.values())
        peers = [f for w in names[1:] for f in ("--peer", f"{hosts[w].address}:{MESH_PORT}")]
        host = spawn(
            "lh", *peers, "--model", "smollm2-135m", "--split", "3", "--placement", "speed",
            "--context", "512", "--speculative", "off", "--wire-dtype", "f32",
        )  # fmt: skip
        placed: list[str] = []

        def ready() -> bool:
            placed[:] = _placed(host) or []
            return bool(placed)

        try:
            wait_for(ready, READY_TIMEOUT_S, "three stages placed and calibrated")
        except WaitTimeout as exc:
            pytest.fail(f"{exc}\n{cluster.logs()}")
        ids = {node.node_id(): name for name, node in {**workers, "lh": host}.items()}
        order = [ids[node] for node in placed]
        why = (host.status().get("host") or {}).get("placed_by")
        logs = cluster.logs()
    assert order[0] == "lh", order
    assert {"l1", "l2"} not in [set(pair) for pair in itertools.pairwise(order)], (order, why, logs)
