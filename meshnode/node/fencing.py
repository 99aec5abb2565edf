"""Fencing and senders on a worker (:mod:`meshnode.node.worker`'s module docstring): who
may send what to the run a node holds, what a refused message is answered, and which
``Prepare`` a node refuses to touch.

Pure decisions over the :class:`~meshnode.node.worker_run.WorkerRun` a claim holds; the
worker sends what they return.
"""

from __future__ import annotations

from typing import Any

from meshnode_packaging.hub import COMMIT
from meshnode_protocol import (
    ActivationBatch,
    ActivationFrame,
    Claim,
    ClaimRejected,
    Error,
    ErrorCode,
    Message,
    Prepare,
)

from meshnode.node.peer_models import PeerModels
from meshnode.node.worker_run import WorkerRun


def may_send(run: WorkerRun, peer: str, message: Message) -> bool:
    """Whether ``peer`` may send ``message`` to ``run``: activations come from the stage's
    upstream (the coordinator when it has none), everything else from the coordinator."""
    if isinstance(message, ActivationFrame | ActivationBatch):
        return peer == (run.upstream or run.coordinator)
    return peer == run.coordinator


def refusals(run: WorkerRun | None, peer: str, message: Any) -> list[Error] | None:
    """None when ``message`` from ``peer`` belongs to the claimed ``run``; else the
    ``Error`` to answer for each of its frames.

    Only the run's own sender (:func:`may_send`) learns what this node holds.
    """
    name = type(message).__name__
    if run is None or not may_send(run, peer, message):
        code, text = ErrorCode.UNKNOWN_RUN, f"{name}: no run of yours on this node"
    elif run.run_id == message.run_id and run.term == message.term:
        return None
    else:
        stale = run.run_id == message.run_id and message.term < run.term
        code = ErrorCode.STALE_TERM if stale else ErrorCode.UNKNOWN_RUN
        text = f"{name} for {message.run_id}@{message.term}; this node holds "
        text += f"{run.run_id}@{run.term}"
    # A refused step is refused frame by frame: each Error names its request, so the
    # stages upstream pass it on to the coordinator like any failure of a frame.
    frames = message.frames if isinstance(message, ActivationBatch) else (message,)
    return [
        Error(
            code=code,
            message=text,
            run_id=message.run_id,
            term=message.term,
            request_id=getattr(frame, "request_id", ""),
        )
        for frame in frames
    ]


def claim_rejection(node_id: str, run: WorkerRun, peer: str, claim: Claim) -> ClaimRejected:
    """The refusal of ``claim`` while this node is held by ``run``."""
    # The run's own coordinator (claiming with an older term) learns which run holds
    # us; another coordinator learns only that this node is taken.
    own = peer == run.coordinator
    return ClaimRejected(
        run_id=claim.run_id,
        term=claim.term,
        node_id=node_id,
        reason=f"held by run {run.run_id}@{run.term}" if own else "claimed by another node",
        held_by_run=run.run_id if own else "",
        held_by_term=run.term if own else 0,
    )


def is_downstream_error(run: WorkerRun | None, peer: str, error: Error) -> bool:
    """Whether ``error`` is ``run``'s downstream stage's answer to a frame of the run."""
    return (
        run is not None
        and bool(error.request_id)
        and error.run_id == run.run_id
        and run.downstream is not None
        and peer == run.downstream
    )


def prepare_refusal(peer_models: PeerModels, prepare: Prepare) -> str:
    """Why this node will not prepare ``prepare`` (empty: it will): a reference its
    ``peer_models`` setting refuses, or a malformed commit pin."""
    if refusal := peer_models.refusal(prepare.package_ref):
        return refusal
    if prepare.commit and not COMMIT.fullmatch(prepare.commit):
        return "commit must be 40 lowercase hex digits"
    return ""
