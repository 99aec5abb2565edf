"""The reliability suite (marker ``reliability``, not in the default run): a real two-stage
mesh of ``meshnode join`` processes (SmolLM2-135M, f32 activations so that greedy output is
the golden reference exactly) under ~10⁶ fuzzed frames and a 64-client HTTP soak.

Run it with ``pytest -m reliability -s tests/reliability`` (``-s`` shows the figures). The
sizes come from the environment: ``MESHNODE_FUZZ_FRAMES`` (default 10⁶),
``MESHNODE_FUZZ_CLOSING`` (malformed frames sent each on its own TLS connection, default
4,000), ``MESHNODE_SOAK_S`` (default 120), ``MESHNODE_SOAK_CLIENTS`` (default 64) and
``MESHNODE_SOAK_ROUNDS`` (default 4: both nodes' RSS is taken, settled, after the warm-up
and after each round; more rounds of the same seconds give a finer trend).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import trio

from meshnode.net.address import Address
from meshnode.net.identity import JoinToken, NodeIdentity
from tests.e2e.cluster import SINGLE_THREAD_ENV, Cluster, Node, init_token, start_split_mesh
from tests.reliability.fuzz import FuzzStats, fuzz_node
from tests.reliability.soak import SoakStats, rss_trend, soak

pytestmark = [pytest.mark.reliability, pytest.mark.real_model]

MODEL = "smollm2-135m"
CONTEXT = 512
READY_TIMEOUT_S = 180.0
FRAMES = int(os.environ.get("MESHNODE_FUZZ_FRAMES", "1000000"))
CLOSING_CAP = int(os.environ.get("MESHNODE_FUZZ_CLOSING", "4000"))
SOAK_S = float(os.environ.get("MESHNODE_SOAK_S", "120"))
SOAK_CLIENTS = int(os.environ.get("MESHNODE_SOAK_CLIENTS", "64"))
#: Rounds of the soak, both nodes' RSS taken after each.
SOAK_ROUNDS = int(os.environ.get("MESHNODE_SOAK_ROUNDS", "4"))
#: Seconds of soak before the RSS baseline is taken.
SOAK_WARM_S = min(30.0, SOAK_S / 4)
#: RSS a node may gain between the end of the warm-up and the end of a phase. A leak of
#: one small object per frame would be ~100 MiB over 10⁶ frames; allocator noise is a few.
RSS_GROWTH_BYTES = 48 << 20
#: Children fetch nothing: hub refs a fuzzed Prepare may name point at a closed port.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Node, Node]]:
    """A worker and the host, two ready stages; default heartbeats (dead after 10 s)."""
    root = tmp_path_factory.mktemp("reliability")
    token = init_token(root / "mesh.token")
    with Cluster(root, env={**SINGLE_THREAD_ENV, **OFFLINE_ENV}) as cluster:
        host = start_split_mesh(
            cluster, token, "--model", MODEL, "--split", "2", "--context", str(CONTEXT),
            "--wire-dtype", "f32", "--dtype", "native",  # exact: the golden output holds
            workers=1, ready_timeout_s=READY_TIMEOUT_S,
        )  # fmt: skip
        worker = next(node for node in cluster.nodes if node is not host)
        yield cluster, host, worker


def _golden_matches(host: Node, golden: dict[str, Any]) -> None:
    with openai.OpenAI(base_url=host.api + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        for case in golden["prompts"]:
            reply = c.completions.create(
                model=MODEL, prompt=case["prompt_ids"], temperature=0, max_tokens=48
            )
            assert reply.choices[0].text == case["gen_text_skip_special"], case["id"]


def _footprint(node: Node) -> tuple[int, int]:
    process = psutil.Process(node.process.pid)
    return process.memory_info().rss, process.num_fds()


def _progress(name: str) -> Callable[[FuzzStats], None]:
    def show(stats: FuzzStats) -> None:
        print(f"  {name}: {stats.line()}", flush=True)

    return show


def _address(node: Node) -> Address:
    return Address.parse(node.listen)


@pytest.mark.timeout(3600)
async def test_fuzzed_frames_close_only_their_connection(
    mesh: tuple[Cluster, Node, Node], golden: dict[str, Any], tmp_path: Path
) -> None:
    cluster, host, worker = mesh
    token = JoinToken.parse((cluster.root / "mesh.token").read_text())

    def identity(name: str) -> NodeIdentity:
        return NodeIdentity.provision(token, tmp_path / name)

    errors_before = {n.name: n.status()["node"]["protocol_errors"] for n in (host, worker)}
    warm = FRAMES // 50
    for node in (worker, host):
        await fuzz_node(identity, _address(node), count=warm, seed=1, closing_cap=warm // 20)
    before = {n.name: _footprint(n) for n in (host, worker)}
    totals: list[FuzzStats] = []
    for index, node in enumerate((worker, host)):
        try:
            stats = await fuzz_node(
                identity, _address(node), count=FRAMES // 2, seed=100 + index,
                closing_cap=CLOSING_CAP // 2, progress=_progress(node.name),
            )  # fmt: skip
        except* OSError:
            # A node that stopped answering is the failure: show why it stopped.
            pytest.fail(f"{node.name} stopped serving:\n{node.log()[-6000:]}")
        print(f"{node.name}: {stats.line()}")
        totals.append(stats)
    after = {n.name: _footprint(n) for n in (host, worker)}
    for name in before:
        rss0, fds0 = before[name]
        rss1, fds1 = after[name]
        print(f"{name}: RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, fds {fds0} -> {fds1}")
        assert rss1 - rss0 < RSS_GROWTH_BYTES, name
        assert fds1 <= fds0 + 8, name  # no connection left open
    for stats in totals:
        assert stats.bugs == []
        assert stats.closed_by_node == stats.closing_sent  # every one closed, none hung
    assert host.alive()
    assert worker.alive()
    for node in (host, worker):
        node_status = node.status()["node"]
        assert node_status["internal_errors"] == 0, node.log()[-4000:]
        assert node_status["protocol_errors"] > errors_before[node.name]
    assert host.status()["host"]["state"] == "ready"
    await trio.to_thread.run_sync(_golden_matches, host, golden)


@pytest.mark.timeout(1800)
async def test_a_64_client_soak_leaves_the_server_serving(
    mesh: tuple[Cluster, Node, Node], golden: dict[str, Any]
) -> None:
    _cluster, host, worker = mesh
    api = Address.parse(host.api.removeprefix("http://"))
    # A warm-up (every client's first requests size the KV caches and buffers), then the
    # soak in rounds, both nodes' RSS taken after each: it must level off, not climb.
    warm = await soak(api, clients=SOAK_CLIENTS, seconds=SOAK_WARM_S, model=MODEL, seed=6)
    assert warm.unexpected == Counter(), warm.table()
    await _settled(host, worker)
    before = _footprint(host)
    served = sum(warm.outcomes.values())
    # (requests served so far, host RSS, worker RSS), settled, after the warm-up and each round
    series = [(served, before[0], _footprint(worker)[0])]
    total = SoakStats()
    for round_ in range(SOAK_ROUNDS):
        stats = await soak(
            api, clients=SOAK_CLIENTS, seconds=SOAK_S / SOAK_ROUNDS, model=MODEL,
            seed=7 + round_,
        )  # fmt: skip
        assert stats.unexpected == Counter(), stats.table()
        await _settled(host, worker)
        served += sum(stats.outcomes.values())
        series.append((served, _footprint(host)[0], _footprint(worker)[0]))
        total.outcomes += stats.outcomes
        total.seconds += stats.seconds
    print(total.table())
    after = _footprint(host)
    print(_rss_table(series))
    print(f"host: fds {before[1]} -> {after[1]}")
    # Flat: the second half of the soak adds less than the bound (the first half may still
    # fill pages of caches that a longer sequence reaches for the first time).
    half = len(series) // 2
    assert series[-1][1] - series[half][1] < RSS_GROWTH_BYTES
    assert series[-1][2] - series[half][2] < RSS_GROWTH_BYTES
    assert after[1] <= before[1] + 8
    assert "Error in ASGI" not in host.log(), host.log()[-4000:]
    await trio.to_thread.run_sync(_golden_matches, host, golden)


def _rss_table(series: list[tuple[int, int, int]]) -> str:
    """RSS after the warm-up and each round, and its trend over the second half."""
    lines = ["RSS, settled, after the warm-up and each round (MiB):", "  requests    host  worker"]
    lines += [f"  {n:8} {h / 2**20:7.1f} {w / 2**20:7.1f}" for n, h, w in series]
    later = series[len(series) // 2 :]
    host = rss_trend([(n, h) for n, h, _ in later])
    worker = rss_trend([(n, w) for n, _, w in later])
    lines.append(
        f"  trend over the second half: host {host:+.2f}, worker {worker:+.2f} MiB per 1,000"
        " requests"
    )
    return "\n".join(lines)


async def _settled(host: Node, worker: Node) -> None:
    """Wait (bounded) until nothing is in flight or held anywhere: requests, sequences."""
    deadline = time.monotonic() + 30
    while True:
        block = host.status()["host"]
        run = worker.status().get("run", {})
        held = (block["requests_in_flight"], block["requests_waiting"], run["live_sequences"])
        if held == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"still held after the soak: {held}"
        await trio.sleep(0.5)
