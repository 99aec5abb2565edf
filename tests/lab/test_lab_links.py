"""A link's bandwidth measured across network namespaces (issue 34): one host's link shaped
with ``tc tbf`` to 2 Mbit/s, another left alone; the probe of ``meshnode.node.links``
(:mod:`tests.lab.link_peer`) tells them apart and finds the shaped one at its rate. Then
one link between two workers shaped alone (``NetLab.shape_pair``): the probes find it
slow both ways and both workers' links to a third fast, and the planner, given those
measurements as the workers' reported links, keeps the two from being neighbours.

Bounded: 256 KiB at 250 kB/s take a second; the processes' start (imports) is
what takes time, and each step waits for its process's own line, with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnode.node.planner import NodeLink, plan
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
