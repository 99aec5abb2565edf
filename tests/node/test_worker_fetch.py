"""The worker's materialization: pins, URL refs from other nodes, Stop, safe error reasons."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trio
from meshnode_packaging.manifest import MANIFEST_NAME
from meshnode_packaging.testing import Fault, LocalHub
from meshnode_protocol import (
    Claim,
    Error,
    ErrorCode,
    Inventory,
    InventoryReport,
    Message,
    PeerInfo,
    Prepare,
    Stop,
)

from meshnode.engine.backend import cpu_backend
from meshnode.node.peer_models import PeerModels
from meshnode.node.progress import DownloadProgress
from meshnode.node.worker import Worker
from meshnode.node.worker_run import MAX_REASON_CHARS
from tests.packaging.tinymodel import write_tiny_gguf

HOST = "host"
RUN = "run-1"
# Served this slowly, the tiny GGUF (745 kB) takes 37 s: a fetch that ends sooner was
# cancelled.
SLOW_BYTES_PER_S = 20_000
# Stop cancels a running materialization within about a second on an idle machine (the
# fetching thread looks between pieces); the bound leaves room for both cores busy with
# other work and is still a fraction of the transfer's 37 s.
CANCEL_WITHIN_S = 10.0
# The hub sees the closed connection at one of its next writes (every 50 ms).
SERVER_NOTICES_S = 10.0
# How long the transfer may take to start, at most.
STARTS_WITHIN_S = 30.0
POLL_S = 0.05


class Harness:
    """One worker, and what it sent back."""

    def __init__(self, worker: Worker, sent: list[Message]) -> None:
        self.worker, self.sent = worker, sent

    async def ask(self, message: Message) -> Message:
        before = len(self.sent)
        await self.worker.handle(HOST, message)
        return self.sent[before]

    async def report(self) -> InventoryReport:
        reply = await self.ask(Inventory(run_id=RUN, term=1, package_ref=""))
        assert isinstance(reply, InventoryReport)
        return reply

    async def until_settled(self) -> InventoryReport:
        with trio.fail_after(60):
            while True:
                report = await self.report()
                if report.ready or report.error:
                    return report
                await trio.sleep(0.05)


def _prepare(ref: str, *, commit: str = "", start: int = 0, end: int = 2) -> Prepare:
    return Prepare(
        run_id=RUN,
        term=1,
        package_ref=ref,
        manifest_sha256="",
        layer_range=(start, end),
        has_embed=start == 0,
        has_head=False,
        commit=commit,
    )


async def _harness(nursery: trio.Nursery, cache: Path, *, accept_url_refs: bool = False) -> Harness:
    sent: list[Message] = []

    async def send(peer: str, message: Message) -> None:
        sent.append(message)

    async def connect(info: PeerInfo) -> None:
        pass

    worker = Worker(
        "worker",
        send,
        connect=connect,
        backend=cpu_backend(),
        cache_dir=cache,
        nursery=nursery,
        peer_models=PeerModels(urls=accept_url_refs),
    )
    h = Harness(worker, sent)
    await h.ask(Claim(run_id=RUN, term=1, coordinator_id=HOST, package_ref=""))
    return h


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.Q4_1.gguf")
    return folder


@pytest.fixture
async def lhub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalHub]:
    with LocalHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h


async def test_stage_reads_the_pinned_commit(
    lhub: LocalHub, repo: Path, tmp_path: Path, nursery: trio.Nursery
) -> None:
    pinned = lhub.add_repo("org/m", repo)
    empty = tmp_path / "moved"
    empty.mkdir()
    lhub.add_repo("org/m", empty)  # main moved on to a commit with no model in it
    h = await _harness(nursery, tmp_path / "cache")
    await h.ask(_prepare("hf://org/m", commit=pinned))
    report = await h.until_settled()
    assert report.error == ""
    assert report.ready == ((0, 2),)


async def test_a_prepared_node_reports_what_it_measured_of_itself(
    lhub: LocalHub, repo: Path, tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Issue 34: the report that says ready carries the node's timing of its first layer,
    cached under its cache folder by model and machine."""
    pinned = lhub.add_repo("org/m", repo)
    h = await _harness(nursery, tmp_path / "cache")
    await h.ask(_prepare("hf://org/m", commit=pinned, start=1, end=2))
    report = await h.until_settled()
    assert report.ready == ((1, 2),)
    assert report.measure_error == ""
    assert 0.0 < report.decode_us < 10e6
    assert 0.0 < report.batch_us < 10e6
    assert 0.0 < report.prefill_us < 10e6
    assert report.layer_bytes > 0
    assert report.free_memory > 0
    # cached by layer, and named as the model's latest (what a SpeedQuery reads)
    cached = sorted(p.name for p in (tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(cached) == 2
    assert cached[-1].startswith("model-")


async def test_bad_commit_and_url_refs_are_refused(
    lhub: LocalHub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    h = await _harness(nursery, tmp_path / "cache")
    reply = await h.ask(_prepare("hf://org/m", commit="../../etc"))
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.PREPARE_FAILED
    reply = await h.ask(_prepare(f"{lhub.endpoint}/org/m/resolve/main"))
    assert isinstance(reply, Error)
    assert "allow_url_models" in reply.message
    assert lhub.requests == []  # nothing was fetched for either


async def test_url_errors_never_echo_what_the_url_served(
    lhub: LocalHub, tmp_path: Path, nursery: trio.Nursery
) -> None:
    secret = tmp_path / "internal"
    secret.mkdir()
    (secret / MANIFEST_NAME).write_text('{"format": {"name": "SECRET-42", "version": 1}}')
    lhub.add_repo("internal/svc", secret)
    h = await _harness(nursery, tmp_path / "cache", accept_url_refs=True)
    await h.ask(_prepare(f"{lhub.endpoint}/internal/svc/resolve/main"))
    report = await h.until_settled()
    assert report.error.startswith("InvalidPackage")
    assert "SECRET" not in report.error


class _Chatty(BaseHTTPRequestHandler):
    """Answers every request with a 500 whose body is a secret only this node can reach."""

    def do_GET(self) -> None:
        body = b"SECRET-BODY internal details"
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def chatty(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A loopback server (also the hub endpoint) whose errors carry a body."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chatty)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield endpoint
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("kind", ["url", "hub"])
async def test_http_errors_report_a_status_never_the_body(
    chatty: str, tmp_path: Path, nursery: trio.Nursery, kind: str
) -> None:
    ref = f"{chatty}/internal/pkg" if kind == "url" else "hf://org/m"
    h = await _harness(nursery, tmp_path / "cache", accept_url_refs=True)
    await h.ask(_prepare(ref))
    report = await h.until_settled()
    assert report.error
    if kind == "url":
        assert "HTTP 500" in report.error
    assert "SECRET" not in report.error
    assert len(report.error) <= MAX_REASON_CHARS


async def test_stop_cancels_a_running_materialization(
    lhub: LocalHub, repo: Path, tmp_path: Path, nursery: trio.Nursery
) -> None:
    lhub.add_repo("org/m", repo)
    lhub.inject("tiny.Q4_1.gguf", *[Fault(bytes_per_s=SLOW_BYTES_PER_S)] * 8)
    h = await _harness(nursery, tmp_path / "cache")
    await h.ask(_prepare("hf://org/m", start=0, end=30))
    for _ in range(int(STARTS_WITHIN_S / POLL_S)):  # until the slow transfer is under way
        if "tiny.Q4_1.gguf" in lhub.bodies_started:
            break
        await trio.sleep(POLL_S)
    assert "tiny.Q4_1.gguf" in lhub.bodies_started
    assert not any(r.path == "tiny.Q4_1.gguf" for r in lhub.requests)  # recorded at its end
    prep = h.worker.run.preparation if h.worker.run else None
    assert prep is not None
    await h.worker.handle(HOST, Stop(run_id=RUN, term=1, reason="test"))
    with trio.fail_after(CANCEL_WITHIN_S):
        await prep.done.wait()
    assert prep.error.startswith("Cancelled")
    # The connection is closed, not left streaming for the half minute the file would take
    # (the server sees it at one of its next writes, into a socket buffer first).
    for _ in range(int(SERVER_NOTICES_S / POLL_S)):
        if any(r.path == "tiny.Q4_1.gguf" for r in lhub.requests):
            break
        await trio.sleep(POLL_S)
    assert any(r.path == "tiny.Q4_1.gguf" for r in lhub.requests)


def test_download_progress_lines() -> None:
    p = DownloadProgress("stage on b")
    assert p.update(0, 0, 0.0) is None  # nothing known yet
    assert p.update(0, 100_000_000, 10.0) == "stage on b: 0.0 of 100.0 MB (0 %), rate unknown yet"
    assert p.update(10_000_000, 100_000_000, 12.0) is None  # within LOG_EVERY_S
    line = p.update(50_000_000, 100_000_000, 20.0)
    assert line == "stage on b: 50.0 of 100.0 MB (50 %), 5.0 MB/s, ETA 10 s"
    assert p.update(100_000_000, 100_000_000, 21.0) == (
        "stage on b: 100.0 of 100.0 MB (100 %), done in 11.0 s"
    )
    assert p.update(100_000_000, 100_000_000, 40.0) is None  # said once
