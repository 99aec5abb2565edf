"""What a request is told while the host has no pipeline: one 503 message per mesh state.

The coordinator's state (``host`` part of ``GET /v1/mesh/status``) says why nothing serves:
still planning, no plan fits the live nodes, stages loading, a failed bring-up, a lost
stage, or a drain before the plan grows back. :func:`unavailable_message` is a pure table
from that status body to the sentence the client reads, so a user waiting on a 503 learns
whether to wait a few seconds or to start another node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["unavailable_message"]


def unavailable_message(host: Mapping[str, Any]) -> str:
    """The 503 message for the host status body ``host`` (its ``state``, ``error``,
    ``last_failure`` and ``stages``)."""
    state = str(host.get("state", "starting"))
    error = str(host.get("error") or "")
    if state == "planning" and error:
        return f"No plan fits the mesh yet: {error}. Waiting for more nodes to join."
    if state == "loading":
        return f"The mesh is loading the model ({_stage_progress(host)}); retry shortly."
    if state == "failed":
        retry = host.get("retry_in_s")
        when = "replanning" if retry is None else f"trying again in {retry:g} s"
        return f"Bringing up the model failed ({error}); the mesh is {when}."
    if state == "replanning":
        failure = str(host.get("last_failure") or "a stage failed")
        return f"The mesh is replanning ({failure}); retry shortly."
    if state == "draining":
        return "The mesh is re-placing the model on the nodes that came back; retry shortly."
    return _SIMPLE.get(state, "The mesh is loading the model; retry shortly.")


_SIMPLE = {
    "starting": "The host is starting; retry shortly.",
    "planning": "The mesh is planning where the model's layers go; retry shortly.",
    "ready": "The mesh is switching to its new pipeline; retry shortly.",
}


def _stage_progress(host: Mapping[str, Any]) -> str:
    stages = list(host.get("stages") or ())
    if not stages:
        return "no stage placed yet"
    ready = sum(1 for stage in stages if stage.get("state") == "ready")
    done = sum(int(stage.get("bytes_done") or 0) for stage in stages)
    total = sum(int(stage.get("bytes_total") or 0) for stage in stages)
    fetched = f", {100 * done // total}% of its files fetched" if total else ""
    return f"{ready} of {len(stages)} stages ready{fetched}"
