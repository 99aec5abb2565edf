"""A worker's part in one run, as records: what a claim holds (:class:`WorkerRun`), the
part it materializes (:class:`Preparation`) and where it stands (:class:`RunState`).

Apart from the worker's control plane (:mod:`meshnode.node.worker`) and its data plane
(:mod:`meshnode.node.relay`), which both read and write them, so that neither imports the
other for its types.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import trio
from meshnode_packaging.errors import FetchError, RefError
from meshnode_packaging.manifest import Part
from meshnode_packaging.refs import is_url
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import ActivationBatch, ActivationFrame, Error, ErrorCode, Release

from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE
from meshnode.node.selfmeasure import SelfMeasure
from meshnode.node.stage import StageRunner
from meshnode.node.wire import WireSequences

#: What a loaded run's inbox carries, in arrival order (:mod:`meshnode.node.relay`).
DataMessage = ActivationFrame | ActivationBatch | Release

# A failure reason travels to another node; a longer one is cut.
MAX_REASON_CHARS = 300


def failure_reason(exc: Exception, package_ref: str) -> str:
    """What a failed preparation tells the node that asked: our own words only.

    Fetch and reference errors are written by us (a status and a short reason, never a remote
    body). Anything else about a URL reference may quote what the URL served (a manifest's
    fields), which would make this node a read channel into hosts only it can reach: only
    the error's type is told then.
    """
    if isinstance(exc, FetchError | RefError) or not is_url(package_ref):
        return f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
    return f"{type(exc).__name__} (details in this node's log)"


@dataclass(slots=True)
class Preparation:
    """A part being materialized in the background, and how far it got."""

    package_ref: str
    part: Part
    pin: str = ""  # the host's pin: a hub commit or a URL package's manifest sha256
    bytes_done: int = 0
    bytes_total: int = 0
    source: ModelSource | None = None
    failure: Exception | None = None  # why materializing failed (kept for the log)
    # what the node measured of itself on the part's first layer, or why it could not
    # (meshnode.node.selfmeasure); None: not yet
    measured: SelfMeasure | str | None = None
    done: trio.Event = field(default_factory=trio.Event)
    # Set by Stop (or a newer Prepare): the fetching thread gives up within about a second.
    cancel: threading.Event = field(default_factory=threading.Event)

    def progress(self, done: int, total: int) -> None:
        # Called from the fetching thread; two int stores are atomic under the GIL.
        self.bytes_done, self.bytes_total = done, total

    @property
    def error(self) -> str:
        """What the failure tells other nodes (:func:`failure_reason`); empty if none."""
        return "" if self.failure is None else failure_reason(self.failure, self.package_ref)


class RunState(enum.StrEnum):
    """Where this node's part in a run stands (``meshnode status`` shows the value)."""

    CLAIMED = "claimed"
    PREPARING = "preparing"
    PREPARED = "prepared"
    READY = "ready"
    FAILED = "failed"


@dataclass(slots=True)
class WorkerRun:
    """This node's part in one run."""

    run_id: str
    term: int
    coordinator: str
    preparation: Preparation | None = None
    runner: StageRunner | None = None
    upstream: str | None = None  # who sends us activations (None: the coordinator itself)
    downstream: str | None = None
    wire_dtype: str = "f16"
    state: RunState = RunState.CLAIMED
    # Sampling and reused activation buffers of the sequences passing through this stage.
    wire: WireSequences = field(default_factory=lambda: WireSequences(MAX_SEQUENCES_PER_STAGE))
    # The loaded run's data messages, served in order by its inbox task (module docstring).
    inbox: trio.MemorySendChannel[DataMessage] | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    # When the compute pass in progress began (trio clock; None: idle), for the
    # coordinator's probe after a missed pass deadline (InventoryReport.busy_ms).
    busy_since: float | None = None
    # Set when the inbox task has ended: no forward of this run touches its runner any more.
    idle: trio.Event = field(default_factory=trio.Event)

    def error(self, code: ErrorCode, reason: str, request_id: str = "") -> Error:
        """An ``Error`` about this run, for its coordinator (``request_id``: the request it
        fails)."""
        return Error(
            code=code, message=reason, run_id=self.run_id, term=self.term, request_id=request_id
        )
