"""A node's self-measurement (issue 34): one real layer timed, the disk read, cached by
model and machine, a failure reported as its reason."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from meshnode_packaging.sources import open_source

from meshnode.engine import selftime
from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.node import selfmeasure
from meshnode.node.selfmeasure import SelfMeasure, disk_read_rate, measure_or_reason
from tests.engine.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "Q8_0")


def test_one_real_layer_is_timed_at_each_shape(tiny: Path) -> None:
    source = open_source(tiny)
    timing = selftime.time_layer(ModelConfig.from_hf(source.config), source, 1, cpu_backend())
    for seconds in (timing.decode_s, timing.batch_s, timing.prefill_s):
        assert 0.0 < seconds < 10.0
        assert math.isfinite(seconds)
    assert timing.layer_bytes > 0


def test_the_disk_rate_reads_a_bounded_slice(tmp_path: Path) -> None:
    big = tmp_path / "model.gguf"
    big.write_bytes(bytes(16 << 20))
    assert disk_read_rate(big, n_bytes=8 << 20) > 0.0
    assert disk_read_rate(tmp_path) > 0.0  # a folder: its largest file
    small = tmp_path / "small" / "model.gguf"
    small.parent.mkdir()
    small.write_bytes(bytes(1 << 20))
    assert disk_read_rate(small) == 0.0  # too small to tell
    assert disk_read_rate(tmp_path / "missing") == 0.0


def _fake(calls: list[int]) -> object:
    def measure(*_: object) -> SelfMeasure:
        calls.append(1)
        return SelfMeasure(1e-4, 2e-5, 1e-5, 1000, 1e9)

    return measure


def test_cached_by_model_and_machine(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(selfmeasure, "measure", _fake(calls))
    source, backend = open_source(tiny), cpu_backend()

    def ask(model_id: str = "m") -> SelfMeasure | str:
        return measure_or_reason(source, 1, backend, model_id=model_id, cache_dir=tmp_path)

    first = ask()
    assert isinstance(first, SelfMeasure)
    assert ask() == first
    assert len(calls) == 1  # the second answer came from the cache file
    assert list((tmp_path / "calibration").glob("*.json"))
    ask("another model")
    assert len(calls) == 2
    monkeypatch.setattr(selfmeasure, "compute_threads", lambda: 97)  # a changed machine
    ask()
    assert len(calls) == 3
    (next((tmp_path / "calibration").glob("*.json"))).write_text("{not json")
    assert isinstance(ask("another model"), SelfMeasure)  # a damaged file is a miss


def test_a_failure_is_the_reason(tiny: Path, tmp_path: Path) -> None:
    source = open_source(tiny)
    reason = measure_or_reason(source, 999, cpu_backend(), model_id="m", cache_dir=tmp_path)
    assert isinstance(reason, str)
    assert "ValueError" in reason
    assert selfmeasure.report_fields(reason) == {"measure_error": reason}
