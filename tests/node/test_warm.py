"""The first plan of a warm mesh (issue 34): a node answers a ``SpeedQuery`` from its
cache without a claim, the host records the answers as bounded claims, and plans by speed
only when every candidate has one; a cold machine leaves the plan to memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import trio
from meshnode_packaging.sources import open_source
from meshnode_protocol import (
    BATCH_FEATURE,
    SPEED_QUERY_FEATURE,
    Hello,
    Load,
    Message,
    PeerInfo,
    SpeedQuery,
    SpeedReport,
)

from meshnode.engine.backend import cpu_backend
from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node import selfmeasure
from meshnode.node.claims import ClaimBook
from meshnode.node.planner import NodeCapacity, NodeSpeed, plan
from meshnode.node.selfmeasure import SelfMeasure, latest, measure_or_reason, speed_report
from meshnode.node.warm import SpeedQueries
from meshnode.node.wire import for_peer
from meshnode.node.worker import Worker
from tests.engine.tiny import write_tiny_model
from tests.node.inmemory import HOST, InMemoryMesh, add_worker, decode, greedy_reference, split_host
from tests.node.member import Member, start_node
from tests.node.test_planner import MODEL  # 30 layers of 4 MiB

MIB = 1 << 20
REF = "hf://org/model"


def answer(node: str = "a", nonce: int = 1, **fields: Any) -> SpeedReport:
    base: dict[str, Any] = {
        "node_id": node,
        "nonce": nonce,
        "package_ref": REF,
        "layer": 3,
        "decode_us": 1000.0,
        "batch_us": 200.0,
        "prefill_us": 100.0,
        "layer_bytes": 4 * MIB,
        "disk_bytes_per_s": 2e9,
    }
    return SpeedReport(**(base | fields))


# -- the node's side: its cache, answered ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "Q8_0")


def test_a_node_answers_from_its_cache_and_a_cold_one_with_nothing(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = SelfMeasure(1e-4, 2e-5, 1e-5, 1000, 1e9)
    monkeypatch.setattr(selfmeasure, "measure", lambda *_: measured)
    source, backend = open_source(tiny), cpu_backend()
    query = SpeedQuery(node_id="h", nonce=7, package_ref=REF, pin="c" * 40)
    cold = speed_report(query, "a", backend, tmp_path)
    assert (cold.nonce, cold.decode_us, cold.layer) == (7, 0.0, 0)
    model_id = f"{REF}@{'c' * 40}"
    assert measure_or_reason(source, 1, backend, model_id=model_id, cache_dir=tmp_path) == measured
    warm = speed_report(query, "a", backend, tmp_path)
    assert (warm.node_id, warm.nonce, warm.layer) == ("a", 7, 1)
    assert warm.decode_us == pytest.approx(100.0)
    assert warm.batch_us == pytest.approx(20.0)
    assert (warm.layer_bytes, warm.disk_bytes_per_s) == (1000, 1e9)
    # another pin, another machine: nothing
    assert speed_report(dataclasses.replace(query, pin=""), "a", backend, tmp_path).decode_us == 0
    assert speed_report(query, "a", backend, None).decode_us == 0
    monkeypatch.setattr(selfmeasure, "compute_threads", lambda: 97)
    assert latest(tmp_path, model_id, backend) is None


def test_a_model_file_replaced_since_is_not_answered_for(tmp_path: Path, tiny: Path) -> None:
    measured = SelfMeasure(1e-4, 2e-5, 1e-5, 1000, 0.0)
    copy = tmp_path / "model.gguf"
    copy.write_bytes(
        tiny.read_bytes() if tiny.is_file() else next(tiny.glob("*.gguf")).read_bytes()
    )
    source, backend = open_source(copy), cpu_backend()
    key = selfmeasure.model_key("m@", backend)
    folder = tmp_path / "cache"
    assert latest(folder, "m@", backend) is None  # nothing yet
    selfmeasure.remember_latest(folder / "calibration", key, measured, 2, source)
    assert latest(folder, "m@", backend) == (measured, 2)
    copy.write_bytes(copy.read_bytes() + b"x")  # the same path, another file
    assert latest(folder, "m@", backend) is None
    (folder / "calibration" / f"{key}.json").write_text("{not json")
    assert latest(folder, "m@", backend) is None


def test_a_query_goes_only_to_a_peer_that_answers_queries() -> None:
    query = SpeedQuery(node_id="h", nonce=1, package_ref=REF)
    assert for_peer(query, frozenset({SPEED_QUERY_FEATURE})) == (query,)
    assert for_peer(query, frozenset({BATCH_FEATURE})) == ()
    assert for_peer(answer(), frozenset()) == ()


# -- the host's side: answers as bounded claims ---------------------------------------------


@pytest.mark.parametrize(
    ("fields", "speed", "shown"),
    [
        ({}, NodeSpeed(4 * MIB / 1e-3, 2e9), 1000.0),
        ({"decode_us": 0.0}, None, None),  # nothing cached: nothing recorded
        ({"decode_us": float("nan")}, None, "claim refused: decode_us nan"),
        ({"batch_us": -1.0}, None, "claim refused: batch_us -1.0"),
        ({"disk_bytes_per_s": 1e15}, None, "claim refused: disk_bytes_per_s"),
        ({"layer": 30}, None, "claim refused: layer 30 is not one of the model's 30"),
        ({"layer": (1 << 64) - 1}, None, "claim refused: layer 18446744073709551615"),
        ({"decode_us": 1e-6}, None, "claim refused: a decode rate"),
    ],
)
def test_an_answer_is_a_claim_bounded_as_a_report_is(
    fields: dict[str, Any], speed: NodeSpeed | None, shown: float | str | None
) -> None:
    book = ClaimBook(MODEL)
    book.record_cached("a", answer(**fields))
    assert book.speed("a") == speed
    seen = book.shown("a")
    if shown is None:
        assert seen is None
    elif isinstance(shown, float):
        assert seen is not None
        assert seen["decode_us"] == shown
    else:
        assert seen is not None
        assert seen["error"].startswith(shown)


# -- the planner's choice: by speed only when every candidate answered ----------------------


def _claims(answers: dict[str, float | None]) -> ClaimBook:
    book = ClaimBook(MODEL)
    for node, decode_us in answers.items():
        if decode_us is not None:
            book.record_cached(node, answer(node, decode_us=decode_us))
    return book


MEMORY = [("h", 9), ("a", 11), ("slow", 10)]  # the memory-weighted plan of the three


@pytest.mark.parametrize(
    ("answers", "expected", "measured"),
    [
        # every node warm, one three times slower: it gets fewer layers (and the head)
        ({"h": 1000.0, "a": 1000.0, "slow": 3000.0}, [("h", 13), ("a", 13), ("slow", 4)], True),
        # every node warm and equal: balanced by time (memory weighting gives 9, 11, 10)
        ({"h": 1000.0, "a": 1000.0, "slow": 1000.0}, [("h", 10), ("a", 10), ("slow", 10)], True),
        # one cold node: by memory, whatever the others answered
        ({"h": 1000.0, "a": 1000.0, "slow": None}, MEMORY, False),
        ({"h": None, "a": 1000.0, "slow": 3000.0}, MEMORY, False),
        # a refused claim counts as none
        ({"h": 1000.0, "a": float("inf"), "slow": 3000.0}, MEMORY, False),
    ],
)
def test_the_first_plan_is_by_speed_only_when_every_node_is_warm(
    answers: dict[str, float | None], expected: list[tuple[str, int]], measured: bool
) -> None:
    book = _claims(answers)
    live = [NodeCapacity(n, 200 * MIB, speed=book.speed(n)) for n in answers]
    result = plan(MODEL, live, host_id="h", context_tokens=1024, split=3)
    assert [(s.node_id, s.end - s.start) for s in result.stages] == expected
    assert result.measured is measured


# -- the queries: asked once, waited for boundedly -----------------------------------------


class Mesh:
    """A ``MeshView`` whose peers answer queries as ``answers`` says (None: never)."""

    node_id = "h"

    def __init__(self, answers: dict[str, float | None]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, Message]] = []
        self.queries: SpeedQueries | None = None
        self.book: ClaimBook | None = None

    def peer_info(self, node_id: str) -> PeerInfo:
        return PeerInfo(node_id=node_id, address=f"{node_id}.invalid:7470")

    async def send(self, node_id: str, message: Message) -> None:
        self.sent.append((node_id, message))
        decode_us = self.answers[node_id]
        if decode_us is not None and isinstance(message, SpeedQuery):
            assert self.queries is not None
            assert self.book is not None
            report = answer(node_id, message.nonce, decode_us=decode_us)
            self.queries.deliver(node_id, report, self.book)


def _queries(tmp_path: Path, host_warm: bool, **kwargs: Any) -> tuple[SpeedQueries, ClaimBook]:
    backend = cpu_backend()
    if host_warm:
        measured = SelfMeasure(1e-3, 2e-4, 1e-4, 4 * MIB, 2e9)
        key = selfmeasure.model_key(f"{REF}@", backend)
        selfmeasure._write(tmp_path / "calibration", key, {
            **dataclasses.asdict(measured), "layer": 0, "path": "", "file": ""})  # fmt: skip
    return SpeedQueries(REF, "", backend=backend, cache_dir=tmp_path, **kwargs), ClaimBook(MODEL)


def _nodes(*names: str) -> list[NodeCapacity]:
    return [NodeCapacity(n, 200 * MIB) for n in ("h", *names)]


async def test_every_node_is_asked_once_and_its_answer_is_its_claim(
    tmp_path: Path, autojump_clock: Any
) -> None:
    mesh = Mesh({"a": 1000.0, "b": 3000.0})
    mesh.queries, mesh.book = _queries(tmp_path, host_warm=True)
    began = trio.current_time()
    await mesh.queries.ask(mesh, mesh.book, _nodes("a", "b"))  # type: ignore[arg-type]
    assert trio.current_time() == began  # every answer came: no waiting
    assert [node for node, _ in mesh.sent] == ["a", "b"]
    assert mesh.book.speed("h") == NodeSpeed(4 * MIB / 1e-3, 2e9)
    assert mesh.book.speed("b") == NodeSpeed(4 * MIB / 3e-3, 2e9)
    await mesh.queries.ask(mesh, mesh.book, _nodes("a", "b"))  # type: ignore[arg-type]
    assert len(mesh.sent) == 2  # asked once
    # a second answer tells links only, and one to no query is dropped
    mesh.queries.deliver("b", answer("b", 2, decode_us=10.0), mesh.book)
    mesh.queries.deliver("c", answer("c", 1), mesh.book)
    assert mesh.book.speed("b") == NodeSpeed(4 * MIB / 3e-3, 2e9)
    assert mesh.book.speed("c") is None


async def test_the_wait_is_bounded_and_a_cold_answer_ends_it(
    tmp_path: Path, autojump_clock: Any
) -> None:
    mesh = Mesh({"a": 1000.0, "silent": None})
    mesh.queries, mesh.book = _queries(tmp_path, host_warm=True, timeout_s=1.0)
    began = trio.current_time()
    await mesh.queries.ask(mesh, mesh.book, _nodes("a", "silent"))  # type: ignore[arg-type]
    assert trio.current_time() - began == pytest.approx(1.0)  # the silent one: the bound
    mesh = Mesh({"cold": 0.0, "silent": None})
    mesh.queries, mesh.book = _queries(tmp_path, host_warm=True, timeout_s=1.0)
    began = trio.current_time()
    await mesh.queries.ask(mesh, mesh.book, _nodes("cold", "silent"))  # type: ignore[arg-type]
    assert trio.current_time() == began  # by memory anyway: no wait for the silent one


@pytest.mark.parametrize(("host_warm", "enabled"), [(False, True), (True, False)])
async def test_a_cold_host_or_placement_by_memory_waits_for_no_claim(
    tmp_path: Path, autojump_clock: Any, host_warm: bool, enabled: bool
) -> None:
    """Neither plans by speed: the nodes are asked all the same (the query introduces them
    to each other, for their links: node/links.py), but the plan waits for no answer."""
    mesh = Mesh({"a": None, "b": None})
    mesh.queries, mesh.book = _queries(tmp_path, host_warm=host_warm, enabled=enabled)
    began = trio.current_time()
    await mesh.queries.ask(mesh, mesh.book, _nodes("a", "b"))  # type: ignore[arg-type]
    assert trio.current_time() == began
    queries = [(node, m) for node, m in mesh.sent if isinstance(m, SpeedQuery)]
    assert [(node, [p.node_id for p in m.peers]) for node, m in queries] == [
        ("a", ["b"]),
        ("b", ["a"]),
    ]
    assert len(mesh.sent) == 2


# -- a warm mesh on real workers: placed by speed at once, loaded once ----------------------


def _seed(cache_dir: Path, ref: str, decode_s: float) -> None:
    """What an earlier bring-up of ``ref`` left in a node's cache: its measurement."""
    measured = SelfMeasure(decode_s, decode_s / 4, decode_s / 8, 1, 0.0)
    key = selfmeasure.model_key(f"{ref}@", cpu_backend())  # the in-memory host pins nothing
    body = {**dataclasses.asdict(measured), "layer": 0, "path": "", "file": ""}
    selfmeasure._write(cache_dir / "calibration", key, body)


@pytest.mark.parametrize("warm", [True, False])
async def test_a_warm_mesh_is_placed_by_speed_at_its_first_plan_and_loaded_once(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, warm: bool
) -> None:
    """Warm: the host and w measured themselves for this model before, w ten times faster;
    the first plan gives w the layers memory weighting would give the host, and each stage
    is loaded once. Cold: the same mesh is placed by memory."""
    ref, package = hub_ref
    reference = greedy_reference(package)
    if warm:
        _seed(tmp_path / "host", ref, 1e-3)
        _seed(tmp_path / "w", ref, 1e-4)
    mesh = InMemoryMesh(host_memory=1 << 34)
    loads: list[str] = []
    deliver = mesh.deliver

    async def counting(sender: str, receiver: str, message: Message) -> None:
        if isinstance(message, Load):
            loads.append(receiver)
        await deliver(sender, receiver, message)

    monkeypatch.setattr(mesh, "deliver", counting)
    async with trio.open_nursery() as nursery:
        add_worker(mesh, "w", tmp_path / "w", nursery)
        coordinator, next_pipeline = split_host(mesh, hub_ref, nursery, cache_dir=tmp_path / "host")
        first = await next_pipeline()
        assert first is not None
        status = coordinator.status()
        layers = [(s["node_id"], *s["layers"]) for s in status["stages"]]
        if warm:
            assert layers == [(HOST, 0, 1), ("w", 1, 3)]
            assert status["placed_by"] == "speed"
        else:
            assert layers == [(HOST, 0, 2), ("w", 2, 3)]
            assert status["placed_by"] == "memory"
        assert await decode(first) == reference
        assert loads == ["w"]  # one Load: no second bring-up before or after the request
        assert coordinator.status()["state"] == "ready"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("ref", "answered"), [(REF, True), ("/srv/models/private.gguf", False)])
async def test_a_worker_answers_without_a_claim_and_only_for_a_model_it_would_open(
    tmp_path: Path, ref: str, answered: bool
) -> None:
    """A worker holding no run answers a query from its cache at once; for a local path
    its config does not name (a model it would refuse to prepare) it answers nothing."""
    _seed(tmp_path, ref, 1e-3)
    sent: list[tuple[str, Message]] = []

    async def send(peer: str, message: Message) -> None:
        sent.append((peer, message))

    async def connect(_: object) -> None:
        raise AssertionError("a query dials nobody")

    async with trio.open_nursery() as nursery:
        node = Worker("w", send, connect=connect, backend=cpu_backend(), cache_dir=tmp_path,
                      nursery=nursery)  # fmt: skip
        query = SpeedQuery(node_id="h", nonce=5, package_ref=ref)
        assert await node.handle("h", query)
    assert node.run is None  # no claim was taken
    [(peer, report)] = sent
    assert peer == "h"
    assert isinstance(report, SpeedReport)
    assert report.nonce == 5
    assert report.decode_us == (pytest.approx(1000.0) if answered else 0.0)


async def test_the_real_daemon_offers_and_answers_speed_queries(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon on loopback and a member (mutual TLS) whose Hello offers ``speed-query``:
    the node's Hello offers it too, and a query is answered over the session, without a
    claim (a cold cache: an empty answer with the query's nonce, saying that the node
    measures itself now)."""
    # the measurement it starts fetches the model's first layer: from nowhere, in a test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    member = await Member.dial(
        NodeIdentity.provision(token, tmp_path / "me"), node.listen, hello=False
    )
    hello = member.hello()
    await member.send(dataclasses.replace(hello, features=(*hello.features, SPEED_QUERY_FEATURE)))
    theirs = await member.receive(Hello)
    assert isinstance(theirs, Hello)
    assert SPEED_QUERY_FEATURE in theirs.features
    await member.send(SpeedQuery(node_id=member.node_id, nonce=11, package_ref=REF))
    report = await member.receive(SpeedReport)
    assert isinstance(report, SpeedReport)
    assert (report.node_id, report.nonce, report.decode_us) == (node.node_id, 11, 0.0)
    assert report.measuring
    await member.aclose()
