"""What a worker tells of the run it holds: its part of ``GET /v1/mesh/status`` and the
``InventoryReport`` the coordinator polls (progress, what it measured of itself, how long
its pass in progress has run).
"""

from __future__ import annotations

from typing import Any

import psutil
import trio
from meshnode_packaging.manifest import Part
from meshnode_protocol import InventoryReport, PeerLink

from meshnode.node.selfmeasure import report_fields
from meshnode.node.worker_run import WorkerRun


def _range(part: Part) -> tuple[int, int]:
    return (part.start, part.end)


def run_status(run: WorkerRun) -> dict[str, Any]:
    """``run`` as this node's status shows it: its claim, its part's progress, and once
    loaded its sequences, memory and KV."""
    prep = run.preparation
    body: dict[str, Any] = {
        "run_id": run.run_id,
        "term": run.term,
        "coordinator": run.coordinator,
        "state": str(run.state),
    }
    if prep is not None:
        body["layers"] = list(_range(prep.part))
        body["bytes_done"] = prep.bytes_done
        body["bytes_total"] = prep.bytes_total
        body["error"] = prep.error
    if run.runner is not None:
        body["live_sequences"] = run.runner.live_sequences
        body["memory"] = run.runner.memory()
        body["kv"] = run.runner.kv_usage()
    return body


def inventory_report(
    node_id: str, run: WorkerRun, links: tuple[PeerLink, ...] = ()
) -> InventoryReport:
    """What this node holds of ``run``'s part: ready, preparing or missing, and progress,
    and its measured ``links`` to its peers."""
    prep = run.preparation
    if prep is None:
        return InventoryReport(
            run_id=run.run_id, term=run.term, node_id=node_id, package_ref="", links=links
        )
    ready = prep.source is not None
    span = (_range(prep.part),)
    return InventoryReport(
        run_id=run.run_id,
        term=run.term,
        node_id=node_id,
        package_ref=prep.package_ref,
        ready=span if ready else (),
        preparing=() if ready or prep.error else span,
        missing=span if prep.error else (),
        embed_ready=ready and prep.part.embed,
        head_ready=ready and prep.part.head,
        bytes_done=prep.bytes_done,
        bytes_total=prep.bytes_total,
        error=prep.error,
        busy_ms=busy_ms(run),
        free_memory=int(psutil.virtual_memory().available),
        links=links,
        **report_fields(prep.measured if ready else None),
    )


def busy_ms(run: WorkerRun) -> int:
    """Milliseconds the run's compute pass in progress has taken so far (0: idle)."""
    if run.busy_since is None:
        return 0
    return max(0, int((trio.current_time() - run.busy_since) * 1000))
