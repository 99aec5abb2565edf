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

#: How long the second failure may take to come, at most (a try verifies the package's
#: sha256; both cores busy make it slow).
SECOND_FAILURE_WITHIN_S = 60.0
POLL_S = 0.05


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

    def retries() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("retrying in")]

    with caplog.at_level(logging.INFO, logger="meshnode.coordinator"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator.run)
            for _ in range(int(SECOND_FAILURE_WITHIN_S / POLL_S)):  # until two have failed
                if len(retries()) >= 2:
                    break
                await trio.sleep(POLL_S)
            nursery.cancel_scope.cancel()
    failed = [r for r in caplog.records if "failed:" in r.getMessage()]
    waits = retries()
    assert [r.getMessage() for r in waits[:2]] == [
        f"retrying in {RETRY_BACKOFF_FIRST_S:.1f} s (failure 1 in a row)",
        f"retrying in {2 * RETRY_BACKOFF_FIRST_S:.1f} s (failure 2 in a row)",  # it grew
    ]
    assert len(failed) == 2, [r.getMessage() for r in failed]
    assert "layers/00001.safetensors: sha256" in failed[0].getMessage()
    assert "is damaged" in coordinator.status()["last_failure"]
    # The second try came after the first delay (however slow the machine: never sooner);
    # without the backoff the coordinator tried again at once, over a hundred times.
    assert failed[1].created - waits[0].created >= RETRY_BACKOFF_FIRST_S
