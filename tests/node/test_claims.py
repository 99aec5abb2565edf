"""A node's claimed speed (issue 34): bounded, in the planner's units, and second to what
serving observes."""

from __future__ import annotations

from typing import Any

import pytest
from meshnode_protocol import InventoryReport

from meshnode.node.claims import ClaimBook, best_speed, claimed_speed
from meshnode.node.planner import NodeSpeed
from meshnode.node.selfmeasure import SelfMeasure
from tests.node.test_planner import MODEL  # 30 layers of 4 MiB

MIB = 1 << 20


def report(**fields: Any) -> InventoryReport:
    base: dict[str, Any] = {
        "run_id": "run-1",
        "term": 1,
        "node_id": "a",
        "package_ref": "m",
        "ready": ((10, 20),),
        "decode_us": 1000.0,
        "batch_us": 200.0,
        "prefill_us": 100.0,
        "layer_bytes": 4 * MIB,
        "disk_bytes_per_s": 2e9,
    }
    return InventoryReport(**(base | fields))


def test_a_claim_is_the_layer_bytes_over_the_time_it_claims() -> None:
    speed = claimed_speed(report(), MODEL)
    assert speed == NodeSpeed(4 * MIB / 1e-3, 2e9)


@pytest.mark.parametrize(
    "fields",
    [
        {"decode_us": 0.0},
        {"measure_error": "RuntimeError: no"},
        {"ready": ()},
    ],
)
def test_no_claim_is_no_speed(fields: dict[str, Any]) -> None:
    assert claimed_speed(report(**fields), MODEL) is None


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"decode_us": float("nan")}, "decode_us nan"),
        ({"decode_us": -5.0}, "decode_us -5.0"),
        ({"decode_us": float("inf")}, "decode_us inf"),
        ({"decode_us": 1e9}, "decode_us"),  # a quarter of an hour a layer
        ({"batch_us": float("nan")}, "batch_us"),
        ({"prefill_us": -1.0}, "prefill_us"),
        ({"disk_bytes_per_s": float("nan")}, "disk_bytes_per_s"),
        ({"disk_bytes_per_s": -1.0}, "disk_bytes_per_s"),
        ({"disk_bytes_per_s": 1e15}, "disk_bytes_per_s"),
        ({"decode_us": 1e-9}, "beyond any machine"),
        ({"ready": ((40, 41),)}, "layer 40"),
    ],
)
def test_a_hostile_claim_is_refused_and_the_node_planned_by_memory(
    fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        claimed_speed(report(**fields), MODEL)
    book = ClaimBook(MODEL)
    book.record("a", report())
    assert book.speed("a") is not None
    book.record("a", report(**fields))  # a later lie replaces the earlier claim
    assert book.speed("a") is None
    shown = book.shown("a")
    assert shown is not None
    assert shown["error"].startswith("claim refused: ")


def test_the_status_shows_a_claim() -> None:
    book = ClaimBook(MODEL)
    assert book.shown("a") is None
    book.record("a", report())
    assert book.shown("a") == {
        "decode_us": 1000.0,
        "batch8_us": 200.0,
        "prefill_us": 100.0,
        "disk_mb_s": 2000,
        "free_memory": 0,
    }
    book.record_own("h", "ValueError: bad layer", 0)
    assert book.shown("h") == {"error": "ValueError: bad layer"}
    assert book.speed("h") is None


def test_what_serving_observes_comes_before_a_claim() -> None:
    observed, claimed = NodeSpeed(1e9), NodeSpeed(9e9, 3e9)
    assert best_speed(observed, claimed) == NodeSpeed(1e9, 3e9)  # the claim's disk only
    assert best_speed(None, claimed) == claimed
    assert best_speed(observed, None) == observed
    assert best_speed(None, None) is None


def test_the_host_measures_itself_as_a_node_does() -> None:
    book = ClaimBook(MODEL)
    book.record_own("h", SelfMeasure(1e-3, 2e-4, 1e-4, 4 * MIB, 0.0), 0)
    assert book.speed("h") == NodeSpeed(4 * MIB / 1e-3)
    shown = book.shown("h")
    assert shown is not None
    assert shown["decode_us"] == 1000.0
    assert shown["free_memory"] > 0  # what this machine has free now
