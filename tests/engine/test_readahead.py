"""Read-ahead of the next layer for a stage served from disk (issue 34): the file-mapped
arrays of each layer are asked for, nothing else; the tokens are the same; the worker
turns it on only when its weights and KV exceed its memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.gguf_file import will_need
from meshnode_packaging.sources import open_source
from meshnode_protocol import Load, PeerInfo

from meshnode.engine.backend import CpuBackend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.readahead import ReadAhead, read_ahead
from meshnode.node.footprint import check_load
from meshnode.node.worker import build_runner
from tests.engine.tiny import greedy, write_tiny_model


def _stage(gguf: Path, weights: str = "native") -> Stage:
    source = open_source(gguf)
    config = ModelConfig.from_hf(source.config)
    backend = CpuBackend(weights_dtype=weights)  # type: ignore[arg-type]
    return Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)


def test_will_need_asks_only_for_views_of_a_file_map(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert will_need(mapped[5000:9000])
    assert will_need(mapped[1:2])  # an unaligned start is rounded down to its page
    assert not will_need(np.zeros(16, np.uint8))  # anonymous memory: nothing to read


def test_read_ahead_asks_for_each_layers_arrays_and_changes_no_token(tmp_path: Path) -> None:
    gguf = write_tiny_model(tmp_path, "Q8_0")
    plain = greedy(_stage(gguf))
    stage = _stage(gguf)
    assert read_ahead(stage)
    assert isinstance(stage.read_ahead, ReadAhead)
    asked: list[int] = []
    inner = stage.read_ahead
    stage.read_ahead = lambda index: asked.append(inner(index))
    assert greedy(stage) == plain
    n_layers = stage.end - stage.start
    # once per layer of every pass (5 passes), each asking for that layer's mapped arrays
    assert len(asked) == 5 * n_layers
    assert all(count > 0 for count in asked)


def test_dequantized_weights_are_not_read_ahead(tmp_path: Path) -> None:
    """float32 weights are copies in memory: nothing of them is on disk to ask for."""
    assert not read_ahead(_stage(write_tiny_model(tmp_path, "Q8_0"), "float32"))


@pytest.mark.parametrize(("memory_bytes", "expected"), [(None, False), (1 << 34, False), (1, True)])
def test_the_worker_reads_ahead_only_when_its_memory_is_short(
    tmp_path: Path, memory_bytes: int | None, expected: bool
) -> None:
    source = open_source(write_tiny_model(tmp_path, "Q8_0"))
    me = PeerInfo(node_id="me", address="127.0.0.1:1")
    load = Load(
        run_id="r", term=1, package_ref="tiny", manifest_sha256="", layer_range=(1, 3),
        has_embed=False, has_head=True, upstream=me, downstream=me, context_size=4,
        kv_dtype="f16",
    )  # fmt: skip
    if memory_bytes == 1:  # above the KV (which must fit), far below the weights
        config = ModelConfig.from_hf(source.config)
        memory_bytes = check_load(config, 1, 3, 4, None, "f16") + 1024
    runner = build_runner(CpuBackend(weights_dtype="native"), source, 1, 3, load, memory_bytes)
    assert (runner.stage.read_ahead is not None) is expected
