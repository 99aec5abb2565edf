"""A bring-up that keeps failing is retried with a growing delay, not in a tight loop; a
damaged local package fails it with a message naming the file (in-memory mesh)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import trio
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import open_ref

from meshnode.engine.backend import cpu_backend
from meshnode.node.coordinator import Coordinator
from meshnode.node.decisions import RETRY_BACKOFF_FIRST_S, RETRY_BACKOFF_MAX_S, retry_delay
from meshnode.node.mesh import CoordinatorSettings
from tests.node.inmemory import CONTEXT, InMemoryMesh

#: How long the failing coordinator runs: room for tries at 0, 0.5 and 1.5 s, not 3.5 s.
WATCH_S = 2.6


def test_retry_delay_doubles_up_to_its_cap() -> None:
    assert retry_delay(0) == 0
    assert [retry_delay(n) for n in (1, 2, 3, 4)] == [
        RETRY_BACKOFF_FIRST_S * f for f in (1, 2, 4, 8)
    ]
    assert retry_delay(50) == RETRY_BACKOFF_MAX_S


async def test_a_damaged_local_package_fails_with_backoff(
    tmp_path: Path, hub_ref: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, package = hub_ref
    damaged = tmp_path / "damaged"
    shutil.copytree(package, damaged)
    layer = damaged / "layers" / "00001.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the sha256 tells
    layer.write_bytes(bytes(data))
    # The embedding is intact: the host opens it at start, as `join` does.
    source = open_ref(damaged, Part(0, 0, embed=True))
    mesh = InMemoryMesh(host_memory=1 << 34)  # the host alone holds every layer
    coordinator = Coordinator(
        mesh,
        CoordinatorSettings(model_ref=str(damaged), context_size=CONTEXT),
        source=source,
        backend=cpu_backend(),
        on_pipeline=lambda pipeline: None,
    )
    mesh.coordinator = coordinator
    backing_off: list[float] = []
    with caplog.at_level(logging.WARNING, logger="meshnode.coordinator"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator.run)
            with trio.move_on_after(WATCH_S):
                while True:
                    await trio.sleep(0.05)
                    if (retry := coordinator.status()["retry_in_s"]) is not None:
                        backing_off.append(retry)
            nursery.cancel_scope.cancel()
    failures = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    # Tries at 0, 0.5 and 1.5 s (the next is due at 3.5 s); a slow machine may fit only
    # two. Without the backoff it is over a hundred.
    assert 2 <= len(failures) <= 3, failures
    assert "layers/00001.safetensors: sha256" in failures[0]
    assert "is damaged" in coordinator.status()["last_failure"]
    assert backing_off
    assert max(backing_off) > RETRY_BACKOFF_FIRST_S  # the delay grew
