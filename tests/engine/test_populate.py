"""Weights faulted in at load when they fit (issue 31): after a stage loads within its
node's memory, every page of its file-mapped weights is in the process's page tables (a
mixture's every expert too), so no first touch costs a fault in a request; a stage served
from disk populates nothing; a kernel that refuses the advice still loads the stage."""

from __future__ import annotations

import errno
import logging
import mmap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging import gguf_file
from meshnode_packaging.gguf_file import Paged, populate
from meshnode_packaging.sources import open_source
from meshnode_protocol import Load, PeerInfo

from meshnode.engine.backend import CpuBackend
from meshnode.engine.config import ModelConfig
from meshnode.engine.cpu import BlockMatrix
from meshnode.engine.model import Stage
from meshnode.engine.readahead import populate_weights, weight_arrays
from meshnode.node import stage_build
from meshnode.node.footprint import check_load
from meshnode.node.worker import build_runner
from tests.engine.moe_models import write_gguf_twin
from tests.engine.tiny import greedy, write_tiny_model

PAGEMAP = Path("/proc/self/pagemap")
PAGE = mmap.PAGESIZE
TABLE = 2 << 20  # bytes one page table maps (x86-64, arm64 with 4 KiB pages)

pytestmark = pytest.mark.skipif(
    not PAGEMAP.exists(), reason="reads which pages are mapped from Linux's /proc/self/pagemap"
)


def _mapped_pages(arrays: Iterable[np.ndarray[Any, Any]]) -> np.ndarray:
    """Whether each page under ``arrays`` is in this process's page tables: bit 63 of its
    ``/proc/self/pagemap`` entry, readable without privileges. (``mincore`` says whether the
    page cache holds a page, which for a file just written is every page, mapped or not.)"""
    present = []
    with PAGEMAP.open("rb") as f:
        for a in arrays:
            if not a.nbytes:
                continue
            first, last = a.ctypes.data // PAGE, (a.ctypes.data + a.nbytes - 1) // PAGE
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
            present.append(entries >> np.uint64(63) == 1)
    return np.concatenate(present)


def _needs_populate(advice: str) -> None:
    if advice == "willneed":
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")


def _load(source: Any, memory_bytes: int | None, start: int = 1) -> Stage:
    """The worker's stage of layers [``start``, 3) (with the head) of the tiny model
    ``source`` on a node offering ``memory_bytes``; 1: more than the KV, far less than the
    weights."""
    me = PeerInfo(node_id="me", address="127.0.0.1:1")
    load = Load(
        run_id="r", term=1, package_ref="tiny", manifest_sha256="", layer_range=(start, 3),
        has_embed=start == 0, has_head=True, upstream=me, downstream=me, context_size=32,
        kv_dtype="f16",
    )  # fmt: skip
    if memory_bytes == 1:
        config = ModelConfig.from_hf(source.config)
        memory_bytes = check_load(config, start, 3, 32, None, "f16") + 1024
    backend = CpuBackend(weights_dtype="native")
    return build_runner(backend, source, start, 3, load, memory_bytes).stage


def test_populate_maps_the_pages_under_views_of_a_file_once(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (4 * TABLE // 256))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    views = [
        mapped[10 * PAGE : 20 * PAGE],
        mapped[15 * PAGE + 7 : 30 * PAGE],  # overlaps the first
        mapped[30 * PAGE : 31 * PAGE],  # touches the second: one run of pages 10..30
        mapped[40 * PAGE + 100 : 40 * PAGE + 200],  # within one page
        np.zeros(PAGE, np.uint8),  # not a file's: skipped
    ]
    assert not _mapped_pages([mapped]).any()  # a fresh map: nothing touched yet
    paged = populate(views)
    _needs_populate(paged.advice)
    assert paged == Paged(22 * PAGE, "populate")  # each page once
    assert _mapped_pages(views[:4]).all()
    # The kernel maps cached neighbours of a faulted page with it (fault-around, 64 KiB
    # by default, never past the page table of the fault): what lies two tables further
    # on stays untouched.
    assert not _mapped_pages([mapped[2 * TABLE :]]).any()
    assert populate([np.zeros(PAGE, np.uint8)]) == Paged(0, "")


def test_a_refused_populate_reads_ahead_and_a_refused_read_ahead_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(8 * PAGE))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    views = [mapped[:PAGE], mapped[3 * PAGE : 5 * PAGE], mapped[7 * PAGE :]]  # three runs
    asked: list[int] = []

    def refuse(refused: set[int]) -> None:
        def madvise(held: mmap.mmap, advice: int, start: int, length: int) -> None:
            asked.append(advice)
            if advice in refused:
                raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(gguf_file, "_madvise", madvise)

    refuse({gguf_file.MADV_POPULATE_READ})  # a kernel before 5.14
    assert populate(views) == Paged(4 * PAGE, "willneed")
    # refused once, then not asked again: each run of pages read ahead instead
    assert asked == [gguf_file.MADV_POPULATE_READ] + [mmap.MADV_WILLNEED] * 3
    asked.clear()
    refuse({gguf_file.MADV_POPULATE_READ, mmap.MADV_WILLNEED})
    assert populate(views) == Paged(0, "")
    assert asked == [gguf_file.MADV_POPULATE_READ, mmap.MADV_WILLNEED]  # then it gives up


@pytest.mark.parametrize(("memory_bytes", "fits"), [(None, True), (1 << 34, True), (1, False)])
def test_a_stage_within_its_memory_has_every_weight_page_mapped_after_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    memory_bytes: int | None,
    fits: bool,
) -> None:
    populated: list[Stage] = []

    def spy(stage: Stage) -> Any:
        populated.append(stage)
        return populate_weights(stage)

    monkeypatch.setattr(stage_build, "populate_weights", spy)
    source = open_source(write_tiny_model(tmp_path, "Q8_0"))
    with caplog.at_level(logging.INFO, logger="meshnode.worker"):
        stage = _load(source, memory_bytes)
    mapped = _mapped_pages(weight_arrays(stage.weights))
    logged = [r.getMessage() for r in caplog.records if "faulted in at load" in r.getMessage()]
    if fits:
        assert populated == [stage]
        assert mapped.all()
        assert len(logged) == 1
        assert logged[0].startswith("layers [1, 3): ")
    else:  # served from disk: read ahead a layer at a time, nothing populated
        assert not populated
        assert stage.read_ahead is not None
        assert not mapped.all()
        assert not logged


def test_every_expert_of_a_mixture_is_faulted_in(tmp_path: Path) -> None:
    source = open_source(write_gguf_twin("qwen3-moe-tiny", tmp_path / "moe.gguf"))
    config = ModelConfig.from_hf(source.config)
    assert config.moe is not None
    backend = CpuBackend(weights_dtype="native")
    stage = Stage(config, source, 0, config.num_layers, embed=True, head=True, backend=backend)
    experts = [e for layer in stage.weights.layers if layer.moe for e in layer.moe.experts]
    assert len(experts) == config.num_layers * config.moe.num_experts
    assert all(isinstance(e.gate_up, BlockMatrix) for e in experts)  # views of the file
    arrays = list(weight_arrays(experts))
    assert not _mapped_pages(arrays).all()  # no expert has run: some never touched
    done = populate_weights(stage)
    _needs_populate(done.advice)
    assert done.nbytes >= sum(a.nbytes for a in arrays if not a.flags.writeable)
    assert _mapped_pages(arrays).all()


def test_a_kernel_refusing_every_advice_still_loads_the_same_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gguf = write_tiny_model(tmp_path, "Q8_0")
    plain = greedy(_load(open_source(gguf), None, start=0))

    def refuse(held: mmap.mmap, advice: int, start: int, length: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(gguf_file, "_madvise", refuse)
    with caplog.at_level(logging.INFO, logger="meshnode.worker"):
        stage = _load(open_source(gguf), None, start=0)  # a new map of the file
    assert populate_weights(stage).advice == ""
    assert not [r for r in caplog.records if "at load" in r.getMessage()]
    assert greedy(stage) == plain
