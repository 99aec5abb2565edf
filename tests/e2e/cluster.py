"""Real `meshnode join` processes on loopback, for end-to-end tests and benchmarks.

A :class:`Cluster` starts children with port 0 for both the mesh and the API, finds their
addresses in ``<state-dir>/node.json``, and kills every child it started when closed (use it
as a context manager or from a fixture's teardown). Every wait is a bounded poll
(:func:`wait_for`): a test that waits on a cluster fails with the children's logs instead of
hanging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest

from meshnode.node.process import read_node_file

# Short timeouts so that membership changes play out in seconds, not minutes.
HEARTBEAT_ENV = {
    "MESHNODE_HEARTBEAT_S": "0.2",
    "MESHNODE_SUSPECT_S": "1.5",
    "MESHNODE_DEAD_S": "3.0",
}
DEAD_AFTER_S = 3.0
# Process start until the API answers: imports dominate, and on a 2-core box shared with
# other test runs (load 8-12) 30 s was measured too short for a child that loads numba.
START_TIMEOUT_S = 120.0
JOIN_CODE = "from meshnode.cli import main; main()"
# One BLAS thread per child: three stages on two cores oversubscribe otherwise, and a
# pipeline's stages run one after another per sequence anyway.
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class WaitTimeout(AssertionError):
    """A bounded wait ran out; the message says what was awaited."""


def hermetic_env(**extra: str) -> dict[str, str]:
    """The environment without any MESHNODE_* settings of the person running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNODE_")}
    return {**env, **extra}


#: How long one ``meshnode`` command may take to end: a hang's bound. A command that
#: refuses a flag ends within a second or two on an idle machine, and took over 30 s with
#: both cores busy and the tests niced (issue 35); pytest's own limit is 300 s a test.
CLI_TIMEOUT_S = 240.0


def cli(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run one ``meshnode`` command to completion (stdout and stderr as text)."""
    return subprocess.run(
        [sys.executable, "-c", JOIN_CODE, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=hermetic_env(),
        check=False,
    )


#: The bound on :func:`compile_kernels`: a first start compiles ~40 s of CPU for SmolLM2
#: in the exact mode (docs/performance.md, "First start"), and both cores may be busy.
COMPILE_TIMEOUT_S = 240.0
#: A prompt for :func:`compile_kernels` (ids every model here has): several rows, so the
#: many-row kernels compile as well as the one-row ones.
COMPILE_PROMPT_IDS = ",".join(str(i) for i in range(1, 13))
_compiled: set[tuple[str, ...]] = set()


def compile_kernels(key: str, model: str, *args: str) -> None:
    """Fill numba's on-disk cache with the kernels that ``meshnode generate --model model
    *args`` runs, once per test process and ``key`` (what the model is, when its path is
    a temporary copy).

    On a fresh clone the cache is empty, and every stage of a mesh compiled the same
    kernels at its first pass, all at once: with both cores busy beside the suite, a
    two-stage mesh took over the 120 s its test allows to become ready, and a stage's
    first pass ran past the replay test's pass deadline. These tests are about the mesh;
    the first start has its own benchmark (``benchmarks/coldstart.py``). A cached
    kernel loads in milliseconds, so on a warm cache this costs one short process.
    """
    if (key, *args) in _compiled:
        return
    result = cli(
        "generate", "--model", model, *args,
        "--prompt-ids", COMPILE_PROMPT_IDS, "--max-tokens", "4", "--json",
        timeout_s=COMPILE_TIMEOUT_S,
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"meshnode generate --model {model} {' '.join(args)} failed:\n{result.stderr}")
    _compiled.add((key, *args))


def init_token(path: Path, name: str = "e2e") -> Path:
    """``meshnode init`` writing a new mesh's join token to ``path``; returns ``path``."""
    result = cli("init", "--name", name, "--token-file", str(path))
    if result.returncode != 0:
        raise RuntimeError(f"meshnode init failed: {result.stderr}")
    return path


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until it is true; the seconds it took.

    A predicate that raises an HTTP error, AssertionError or KeyError counts as false (the
    node may not serve yet). Raises :class:`WaitTimeout` after ``timeout_s``.
    """
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except (httpx.HTTPError, AssertionError, KeyError):
            pass
        if time.monotonic() - start > timeout_s:
            raise WaitTimeout(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def loopback_get(url: str, timeout: float) -> httpx.Response:
    """``GET url`` from this process (the nodes' APIs are on its loopback)."""
    return httpx.get(url, timeout=timeout)


def wait_started(*nodes: Node, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until each node serves its status API (its log is in the failure message)."""
    for node in nodes:
        wait_for(
            lambda n=node: n.alive() and bool(n.status()),  # type: ignore[misc]
            timeout_s,
            f"{node.name} to serve its API\n{node.log()}",
        )


@dataclass
class Node:
    """One child ``meshnode join`` process."""

    name: str
    state_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    # How the test process reaches the node's API (another network namespace's loopback
    # for the lab's nodes, see tests/lab/netlab.py).
    get: Callable[[str, float], httpx.Response] = loopback_get

    @property
    def api(self) -> str:
        """Base URL of the node's HTTP API (from its node.json)."""
        running = read_node_file(self.state_dir)
        assert running is not None, f"{self.name} has no node.json"
        return f"http://{running.api}"

    @property
    def listen(self) -> str:
        """The node's mesh address HOST:PORT."""
        running = read_node_file(self.state_dir)
        assert running is not None, f"{self.name} has no node.json"
        return str(running.listen)

    def status(self) -> dict[str, Any]:
        """``GET /v1/mesh/status``."""
        body: dict[str, Any] = self.get(f"{self.api}/v1/mesh/status", 3.0).json()
        return body

    def node_id(self) -> str:
        return str(self.status()["node"]["node_id"])

    def peer_states(self) -> dict[str, str]:
        return {p["node_id"]: p["state"] for p in self.status()["peers"]}

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Cluster:
    """Children started under ``root``; :meth:`close` kills every one still running."""

    root: Path
    env: dict[str, str] = field(default_factory=lambda: dict(HEARTBEAT_ENV))
    nodes: list[Node] = field(default_factory=list)

    def spawn(
        self,
        name: str,
        token_file: Path,
        *extra: str,
        mdns: bool = True,
        listen: str = "127.0.0.1:0",
        interface: str | None = "127.0.0.1",
        prefix: Sequence[str] = (),
        get: Callable[[str, float], httpx.Response] = loopback_get,
    ) -> Node:
        """Start ``meshnode join`` as ``name`` (state in ``root/name``), by default with port
        0 everywhere on loopback.

        With ``mdns`` discovery runs on ``interface`` only (every interface for ``None``);
        without it the node finds peers through ``--peer`` flags in ``extra``. ``prefix``
        wraps the command (``ip netns exec NS`` for the lab) and ``get`` reaches its API.
        Spawning a name again reuses its state dir (the same identity) and appends to its log.
        """
        state_dir = self.root / name
        state_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"{name}.log"
        pin = ["--interface", interface] if interface is not None else []
        args = [
            "join",
            "--token-file", str(token_file),
            "--listen", listen,
            "--api", "127.0.0.1:0",
            "--state-dir", str(state_dir),
            *(pin if mdns else ["--no-mdns"]),
            *extra,
        ]  # fmt: skip
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [*prefix, sys.executable, "-c", JOIN_CODE, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=hermetic_env(**self.env),
            )
        node = Node(name, state_dir, process, log_path, get)
        self.nodes.append(node)
        return node

    def wait_started(self, *nodes: Node, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until each node (default: all) serves its status API."""
        wait_started(*(nodes or self.nodes), timeout_s=timeout_s)

    def logs(self) -> str:
        """Every child's log, for a failure message."""
        return "\n".join(f"---- {n.name} ----\n{n.log()}" for n in self.nodes)

    def close(self) -> None:
        """Kill every child still running and reap them all."""
        for node in self.nodes:
            if node.alive():
                node.process.kill()
        for node in self.nodes:
            node.process.wait(timeout=10)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def ready_stages(host: Node) -> int:
    """Stages of the host's plan that are ready (0 until the whole run is ready)."""
    block: dict[str, Any] = host.status().get("host", {})
    if block.get("state") != "ready":
        return 0
    return sum(stage["state"] == "ready" for stage in block.get("stages", []))


def start_split_mesh(
    cluster: Cluster,
    token_file: Path,
    *host_args: str,
    workers: int,
    ready_timeout_s: float,
    worker_args: tuple[str, ...] = (),
) -> Node:
    """Start ``workers`` workers (with ``worker_args``), then the host (``host_args`` carry
    ``--model`` and friends) peered to them without mDNS, and wait until every stage of
    ``--split`` is ready.

    Fails the test with every child's log when the mesh does not come up in time.
    """
    nodes = [cluster.spawn(f"w{i}", token_file, *worker_args, mdns=False) for i in range(workers)]
    cluster.wait_started(*nodes)
    peers = [arg for node in nodes for arg in ("--peer", node.listen)]
    host = cluster.spawn("host", token_file, *peers, *host_args, mdns=False)
    cluster.wait_started(host)
    stages = workers + 1
    try:
        wait_for(lambda: ready_stages(host) == stages, ready_timeout_s, f"{stages} ready stages")
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{cluster.logs()}")
    return host


def start_exact_mesh(
    cluster: Cluster,
    token_file: Path,
    model: str,
    *host_args: str,
    workers: int,
    ready_timeout_s: float,
    context: int = 512,
    worker_args: tuple[str, ...] = (),
    key: str | None = None,
) -> Node:
    """:func:`start_split_mesh` serving ``model`` over ``workers`` + 1 stages in the exact
    mode (``--dtype native``: the golden references hold) with float32 on the wire,
    ``host_args`` added to the host's; the kernels compiled first (:func:`compile_kernels`,
    under ``key``, the model's name when its path is a temporary copy)."""
    compile_kernels(key or model, model, "--dtype", "native")
    return start_split_mesh(
        cluster,
        token_file,
        "--model", model,
        "--split", str(workers + 1),
        "--context", str(context),
        "--wire-dtype", "f32",
        "--dtype", "native",
        *host_args,
        workers=workers,
        ready_timeout_s=ready_timeout_s,
        worker_args=worker_args,
    )  # fmt: skip
