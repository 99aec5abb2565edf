"""Telemetry counters: recording, derived rates, merging, dict round trip."""

from __future__ import annotations

import json

import pytest

from meshnode.speculative.telemetry import SpecStats, summarize


def test_record_and_rates() -> None:
    stats = SpecStats()
    stats.record(4, 4, 0.030)  # commits 5
    stats.record(4, 1, 0.020)  # commits 2
    stats.record(0, 0, 0.010)  # plain step
    assert (stats.windows, stats.proposed, stats.accepted) == (2, 8, 5)
    assert stats.accept_rate == pytest.approx(5 / 8)
    assert stats.tokens_per_verify == pytest.approx(7 / 2)
    assert stats.cost_per_accepted_token == pytest.approx(0.050 / 7)
    assert stats.plain_step_seconds == pytest.approx(0.010)


def test_empty_stats_have_no_rates() -> None:
    data = SpecStats().as_dict()
    assert data["accept_rate"] is None
    assert data["tokens_per_verify"] is None
    assert data["cost_per_accepted_token_s"] is None


def test_merge_and_round_trip() -> None:
    a, b = SpecStats(), SpecStats()
    a.record(3, 2, 0.5)
    b.record(5, 5, 1.0)
    b.record(0, 0, 0.25)
    total = summarize([a, b])
    assert total == a.merge(b)
    assert (total.windows, total.proposed, total.accepted, total.plain_steps) == (2, 8, 7, 1)
    data = json.loads(json.dumps(total.as_dict()))
    assert SpecStats.from_dict(data) == total


def test_accepted_beyond_proposed_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        SpecStats().record(2, 3)
