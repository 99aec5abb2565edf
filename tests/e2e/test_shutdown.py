"""A node stopped with SIGTERM says it is stopping, and nothing that reads as a failure.

Real ``meshnode join`` pairs on loopback (a host with ``--split 2`` and one worker): the
stopping node's log says so and names no lost peer, the host does not replan or announce
a new pipeline while it stops, and the node that stays says the other *left*: a host whose
stage node left replans at INFO, with no "lost" stage, and serves again on its own.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import (
    HEARTBEAT_ENV,
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    ready_stages,
    start_split_mesh,
    wait_for,
)

pytestmark = pytest.mark.real_model

READY_TIMEOUT_S = 120.0
#: Words of a failure, a replan or a new pipeline: none belongs in a clean stop.
ALARMS = re.compile(r"\blost\b|replanning|re-placing|serving \S+ on|WARNING|ERROR|Traceback")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    """A host (stage 0) and a worker (stage 1), both ready; ``(host, worker)``."""
    token = init_token(tmp_path / "mesh.token")
    with Cluster(tmp_path, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}) as cluster:
        args = ("--model", "smollm2-135m", "--split", "2", "--context", "256")
        host = start_split_mesh(cluster, token, *args, workers=1, ready_timeout_s=READY_TIMEOUT_S)
        worker = cluster.nodes[0]
        yield host, worker


def _terminate(node: Node) -> str:
    """SIGTERM ``node``, wait for its exit (status 0); its log from the signal on."""
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(timeout=30) == 0, node.log()
    log = node.log()
    assert "SIGTERM: stopping; saying goodbye to 1 peer(s)" in log, log
    return log[log.index("SIGTERM") :]


def test_a_stopping_worker_says_it_is_stopping(pair: tuple[Node, Node]) -> None:
    host, worker = pair
    worker_id = worker.node_id()
    tail = _terminate(worker)
    assert re.search(r"run run-\w+ stopped: this node is stopping", tail), tail
    assert f"node {worker_id} stopped" in tail
    assert not ALARMS.search(tail), tail
    # The host heard a goodbye, not a silence: it replans, as for a loss, but says why.
    wait_for(lambda: f"peer {worker_id} left the mesh" in host.log(), 10, "the host to see it")
    left = re.compile(rf" INFO \S+: run run-\w+: stage node {worker_id} left the mesh; replanning")
    wait_for(lambda: bool(left.search(host.log())), 10, f"the host to log {left.pattern!r}")
    wait_for(lambda: ready_stages(host) == 1, READY_TIMEOUT_S, "the host to serve alone")
    replan = host.log()[host.log().index(f"peer {worker_id} left the mesh") :]
    assert not re.search(r"\blost\b", replan), replan
    assert (
        host.status()["host"]["last_failure"] == f"stage node {worker_id} left the mesh; replanning"
    )


def test_a_stopping_host_neither_replans_nor_serves_again(pair: tuple[Node, Node]) -> None:
    host, worker = pair
    host_id = host.node_id()
    tail = _terminate(host)
    assert f"node {host_id} stopped" in tail
    assert not ALARMS.search(tail), tail
    # The worker drops the claim of a coordinator that left, and says so.
    said = f"stopped: coordinator {host_id} left the mesh"
    wait_for(lambda: said in worker.log(), 10, f"the worker to log {said!r}\n{worker.log()}")
