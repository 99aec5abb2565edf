"""A member cannot make a node open the node's own files as a model (issue 15, item 3).

A ``Prepare`` names the model a worker opens. Before, any member could name a path on the
worker's machine (or anything ``resolve`` turns into one) and the worker opened it: a model
kept there could then be run, or read back through the stage's outputs, and the errors told
which files exist. Now another node's references are limited to the node's setting: hub refs
and bundled aliases, URLs with ``allow_url_models``, and only the local paths the node's own
config names. The node here is the real daemon, driven over a mutual-TLS session.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from meshnode_packaging.refs import RefKind, ref_kind
from meshnode_protocol import (
    Claim,
    ClaimAccepted,
    Error,
    ErrorCode,
    Inventory,
    InventoryReport,
    Prediction,
    Prepare,
    PrepareAccepted,
)

from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node.config import NodeConfig
from meshnode.node.daemon import Node
from meshnode.node.peer_models import PeerModels
from tests.engine.tiny import CONFIG, write_tiny_model
from tests.node.member import Member, activation, start_node

LAYERS = int(CONFIG["num_hidden_layers"])
RUN, TERM = "run-refs", 5
REFUSED = "no other path"


def _prepare(ref: str) -> Prepare:
    return Prepare(
        run_id=RUN, term=TERM, package_ref=ref, manifest_sha256="", layer_range=(0, LAYERS),
        has_embed=True, has_head=True,
    )  # fmt: skip


async def _member(node: Node, token: JoinToken, state_dir: Path) -> Member:
    assert node.listen is not None
    member = await Member.dial(NodeIdentity.provision(token, state_dir), node.listen)
    await member.send(Claim(run_id=RUN, term=TERM, coordinator_id=member.node_id))
    await member.receive(ClaimAccepted)
    return member


def _local_refs(model: Path, tmp_path: Path) -> list[str]:
    """Names of files on the node's machine: the model itself, its checkpoint folder, the
    same file by another spelling, a file that does not exist, and URL-looking paths."""
    relative = Path("..") / ".." / model.relative_to(model.parents[1])
    return [
        str(model),
        str(model.parent / "hf"),
        str(model.parent / "." / ".." / model.parent.name / model.name),
        str(tmp_path / "no-such-model.gguf"),
        str(relative),
        "~/model.gguf",
        f"file://{model}",
    ]


async def test_a_member_cannot_make_a_node_open_local_files(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    model = write_tiny_model(tmp_path / "private", "Q8_0")  # a working model on the node
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    member = await _member(node, token, tmp_path / "me")
    refusals = set()
    for ref in _local_refs(model, tmp_path):
        await member.send(_prepare(ref))
        reply = await member.receive(Error, PrepareAccepted)
        assert isinstance(reply, Error), f"{ref}: {reply}"
        assert reply.code == ErrorCode.PREPARE_FAILED
        assert REFUSED in reply.message
        refusals.add(reply.message)
    # One answer for every path, existing or not: the refusal tells nothing about the disk.
    assert len(refusals) == 1
    await member.send(_prepare("http://127.0.0.1:9/package"))
    reply = await member.receive(Error, PrepareAccepted)
    assert isinstance(reply, Error)
    assert "allow_url_models" in reply.message
    # Nothing was prepared, and the session goes on.
    await member.send(Inventory(run_id=RUN, term=TERM, package_ref=str(model)))
    report = await member.receive(InventoryReport)
    assert isinstance(report, InventoryReport)
    assert (report.package_ref, report.ready, report.preparing) == ("", (), ())
    assert node.worker is not None
    assert node.worker.run is not None
    assert node.worker.run.preparation is None
    assert node.status()["node"]["protocol_errors"] == 0
    assert not member.closed
    await member.aclose()


async def test_a_path_the_node_config_names_is_served(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    model = write_tiny_model(tmp_path / "shared", "Q8_0")
    other = write_tiny_model(tmp_path / "other", "Q8_0")
    token = JoinToken.generate("m")
    node = await start_node(
        nursery, token, tmp_path / "node", tmp_path / "cache", local_models=(model,)
    )
    member = await _member(node, token, tmp_path / "me")
    await member.send(_prepare(str(other)))  # the same kind of file, but not named
    reply = await member.receive(Error, PrepareAccepted)
    assert isinstance(reply, Error)
    assert REFUSED in reply.message
    await member.bring_up(
        node.node_id, run_id=RUN, term=TERM, ref=str(model), layers=(0, LAYERS), embed=True,
        context=32,
    )  # fmt: skip
    await member.send(activation(request_id="r", run_id=RUN, term=TERM, tokens=(1, 2),
                                 hidden_size=None))  # fmt: skip
    answer = await member.receive(Error, Prediction)
    assert isinstance(answer, Prediction), answer
    await member.aclose()


@pytest.mark.parametrize(
    ("ref", "kind"),
    [
        ("hf://org/repo", RefKind.HUB),
        ("hf://org/repo@../../x", RefKind.HUB),  # refused later by the ref grammar
        ("https://host/pkg", RefKind.URL),
        ("http://10.0.0.1/pkg", RefKind.URL),
        ("smollm2-135m", RefKind.ALIAS),
        ("/srv/models/m.gguf", RefKind.LOCAL),
        ("models/m.gguf", RefKind.LOCAL),
        ("file:///etc/passwd", RefKind.LOCAL),
        ("", RefKind.LOCAL),
    ],
)
def test_ref_kinds_are_read_from_the_text(ref: str, kind: RefKind) -> None:
    assert ref_kind(ref) is kind


@pytest.mark.parametrize(
    ("policy", "ref", "accepted"),
    [
        (PeerModels(), "hf://org/repo", True),
        (PeerModels(), "smollm2-135m", True),
        (PeerModels(), "https://host/pkg", False),
        (PeerModels(urls=True), "https://host/pkg", True),
        (PeerModels(urls=True), "/srv/m.gguf", False),
        (PeerModels.of(urls=False, local_paths=["/srv/m.gguf"]), "/srv/m.gguf", True),
        (PeerModels.of(urls=False, local_paths=["/srv/m.gguf"]), "/srv/./x/../m.gguf", True),
        (PeerModels.of(urls=False, local_paths=["/srv/m.gguf"]), "/srv/m.gguf/..", False),
        (PeerModels.of(urls=False, local_paths=["/srv/m.gguf"]), "/srv/n.gguf", False),
        (PeerModels.of(urls=False, local_paths=["/srv"]), "/srv/n.gguf", False),
    ],
)
def test_peer_model_policy(policy: PeerModels, ref: str, accepted: bool) -> None:
    assert (policy.refusal(ref) == "") is accepted


def test_the_config_names_its_own_local_model_and_the_listed_ones(tmp_path: Path) -> None:
    own = tmp_path / "own.gguf"
    config = NodeConfig(model=str(own), local_models=(tmp_path / "b.gguf",))
    policy = PeerModels.of_config(config)
    assert policy.refusal(str(own)) == ""
    assert policy.refusal(str(tmp_path / "b.gguf")) == ""
    assert policy.refusal(str(tmp_path / "c.gguf")) != ""
    hub_host = PeerModels.of_config(NodeConfig(model="hf://org/repo"))
    assert hub_host.local_paths == frozenset()
