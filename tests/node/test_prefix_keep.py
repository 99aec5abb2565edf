"""Cached blocks that outlive a run (node.prefix_keep): the seeds and the identity a pool is
kept by, a stage that takes over an earlier run's pool only when it is the same stage with
the same arithmetic upstream, and the host's belief of what each stage kept.

The model is the tiny random Llama of the prefix tests, run by the real stage builder.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import trio
from meshnode_packaging.sources import ModelSource
from meshnode_protocol import (
    MAX_READY_PREFIX_KEYS,
    Claim,
    ClaimAccepted,
    ClaimRejected,
    Load,
    Message,
    PeerInfo,
    Ready,
)

from meshnode.engine.backend import cpu_backend
from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS as B
from meshnode.engine.prefix_cache import chain_keys
from meshnode.engine.sampling import SamplingParams
from meshnode.node.pipeline import FrameKind, RequestId, StepFrame
from meshnode.node.prefix import PrefixIndex
from meshnode.node.prefix_keep import (
    KeptPool,
    SeedStage,
    held_keys,
    kept_keys,
    stage_identity,
    stage_seeds,
)
from meshnode.node.stage import StageRunner
from meshnode.node.stage_build import build_runner
from meshnode.node.worker import Worker
from tests.speculative.tinymodel import TinySource, tiny_config

CONTEXT = 128
PROMPT = [(5 * i + 2) % 45 + 3 for i in range(2 * B + 3)]
LAYOUT = [SeedStage("cpu:float32", 0, 2), SeedStage("cpu", 2, 3)]
SEED = stage_seeds(
    model=("hf://test/tiny", "c0ffee"), coordinator="host", dtypes=("f32", "", "f32"), stages=LAYOUT
)[1]
OWNER = ("host", "hf://test/tiny", "c0ffee")


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return cast(ModelSource, TinySource(tiny_config(48, 3), seed=0, logit_scale=8.0))


def _load(**changes: Any) -> Load:
    fields: dict[str, Any] = dict(
        run_id="run-1",
        term=1,
        package_ref="hf://test/tiny",
        manifest_sha256="",
        layer_range=(0, 3),
        has_embed=True,
        has_head=True,
        context_size=CONTEXT,
        kv_dtype="f32",
        prefix_seed=SEED,
    )
    return Load(**(fields | changes))


def _build(
    source: ModelSource, load: Load, owner: tuple[str, str, str] = OWNER, **kw: Any
) -> StageRunner:
    start, end = load.layer_range
    return build_runner(cpu_backend(), source, start, end, load, owner=owner, **kw)


def _served(runner: StageRunner) -> StageRunner:
    """``runner`` after it computed ``PROMPT`` (its two full blocks cached) and its run ended."""
    frame = StepFrame(RequestId("r"), FrameKind.PREFILL, 0, tuple(PROMPT), SamplingParams())
    runner.result(frame)
    runner.release_all()
    return runner


BASE: dict[str, Any] = dict(
    model=("hf://test/tiny", "c0ffee"), coordinator="host", dtypes=("f32", "", "f32")
)


def _seeds(stages: list[SeedStage], **changes: Any) -> tuple[str, ...]:
    return stage_seeds(**(BASE | changes), stages=stages)


def test_a_seed_names_what_changes_its_stage() -> None:
    """The last stage's seed, of everything that changes its K/V bits."""
    seeds = {
        _seeds(LAYOUT)[1],
        _seeds(LAYOUT, model=("hf://test/tiny", "beef"))[1],
        _seeds(LAYOUT, coordinator="other")[1],
        _seeds(LAYOUT, dtypes=("f16", "", "f32"))[1],
        _seeds(LAYOUT, dtypes=("f32", "q8", "f32"))[1],
        _seeds(LAYOUT, dtypes=("f32", "", "f16"))[1],
        _seeds([LAYOUT[0], SeedStage("cuda", 2, 3)])[1],  # its own arithmetic
        _seeds([SeedStage("cpu:q8", 0, 2), LAYOUT[1]])[1],  # the host's, upstream
        _seeds([LAYOUT[0], SeedStage("cpu", 1, 3)])[1],  # its range
        _seeds([SeedStage("cpu:float32", 0, 1), SeedStage("cpu", 1, 3)])[1],
    }
    assert len(seeds) == 10
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in seeds)
    assert _seeds(list(LAYOUT))[1] == SEED  # the same plan: the same seed
    assert len(set(_seeds(LAYOUT))) == 2  # each stage its own


def test_a_seed_ignores_what_does_not_change_its_stage() -> None:
    """Not the nodes, nor the stages after it; the cuts upstream only where the wire
    dtype rounds the hidden state crossing them."""
    three = [SeedStage("cpu:q8", 0, 4), SeedStage("cpu", 4, 8), SeedStage("cpu", 8, 12)]
    moved = [SeedStage("cpu:q8", 0, 4), SeedStage("cpu", 4, 6), SeedStage("cpu", 6, 8),
             SeedStage("cpu", 8, 12)]  # fmt: skip
    first, *_ = _seeds(three)
    assert _seeds([SeedStage("cpu:q8", 0, 4), SeedStage("cuda", 4, 12)])[0] == first
    # float32 between the stages: the cut at 6 changes nothing after it
    assert _seeds(moved)[3] == _seeds(three)[2]
    assert _seeds(moved)[2] != _seeds(three)[1]  # its range changed
    # f16 on the wire: a hidden state is rounded at every cut, so the cut counts
    f16 = {"dtypes": ("f32", "", "f16")}
    assert _seeds(moved, **f16)[3] != _seeds(three, **f16)[2]
    # and so does a device upstream, float32 or not
    other = [SeedStage("cpu:q8", 0, 4), SeedStage("cuda", 4, 8), SeedStage("cpu", 8, 12)]
    assert _seeds(other)[2] != _seeds(three)[2]


def test_an_older_host_gets_no_identity() -> None:
    backend = cpu_backend()
    parts: dict[str, Any] = dict(
        coordinator="host", model=OWNER[1:], layers=(0, 3, True, True), kv_dtype="f32"
    )
    assert stage_identity("", **parts, backend=backend, context_size=CONTEXT) == ""
    assert stage_identity(SEED, **parts, backend=backend, context_size=CONTEXT)


def test_the_same_stage_of_the_same_pipeline_takes_the_pool_over(source: ModelSource) -> None:
    old = _served(_build(source, _load()))
    keys = chain_keys(SEED, PROMPT)
    assert len(keys) == 2
    assert held_keys(old.prefix) == tuple(k.hex() for k in keys)  # most recent first
    new = _build(source, _load(run_id="run-2", term=2), kept=old.prefix)
    assert new.prefix is old.prefix
    assert new.prefix.pool is not None
    assert new.prefix.pool.cached_blocks(PROMPT) == 2


@pytest.mark.parametrize(
    ("load", "owner"),
    [
        # another model prepared, whatever the Load and its seed say
        (_load(), ("host", "hf://evil/other", "c0ffee")),
        (_load(), ("host", "hf://test/tiny", "another-pin")),
        (_load(), ("other-host", "hf://test/tiny", "c0ffee")),  # another coordinator
        (_load(layer_range=(0, 2), has_head=False), OWNER),  # another layer range
        (_load(kv_dtype="f16"), OWNER),
        (_load(context_size=2 * CONTEXT), OWNER),
        (_load(prefix_seed="0" * 32), OWNER),  # another pipeline
        (_load(prefix_seed=""), OWNER),  # an older host: keyed by the run, never kept
    ],
    ids=["model", "pin", "coordinator", "layers", "kv-dtype", "context", "seed", "no-seed"],
)
def test_any_other_stage_starts_an_empty_pool(
    source: ModelSource, load: Load, owner: tuple[str, str, str]
) -> None:
    old = _served(_build(source, _load()))
    new = _build(source, load, owner, kept=old.prefix)
    assert new.prefix is not old.prefix
    assert held_keys(new.prefix) == ()


def test_a_pool_whose_sequences_live_on_is_not_taken(source: ModelSource) -> None:
    old = _build(source, _load())
    frame = StepFrame(RequestId("r"), FrameKind.PREFILL, 0, tuple(PROMPT), SamplingParams())
    old.result(frame)  # not released: its sequence still holds blocks
    assert _build(source, _load(run_id="run-2"), kept=old.prefix).prefix is not old.prefix


def test_the_host_believes_what_each_stage_kept(source: ModelSource) -> None:
    """Each stage's keys are its own (its seed), and a stage resumes no later than any
    stage after it: it computes the rows they need."""
    own = _served(_build(source, _load())).prefix
    keys = chain_keys(SEED, PROMPT)
    assert kept_keys(own, []) == keys[::-1]  # alone: all it holds, least recent first
    salts = [SEED, "1" * 32, "2" * 32]
    mid, last = (chain_keys(salt, PROMPT) for salt in salts[1:])
    index = PrefixIndex(salts)
    index.believe(kept_keys(own, [[k.hex() for k in mid[:1]], [k.hex() for k in last[::-1]]]))
    point = index.resume_point(RequestId("q"), PROMPT)
    assert point.starts == (B, B, 2 * B)  # stage 1 holds one block: stage 0 starts there too
    assert point.keys == (keys[0], mid[0], last[1])
    index.missed(PROMPT)  # a stage lacked it: no stage is believed to hold it any more
    assert index.resume_point(RequestId("q"), PROMPT).starts == (0, 0, 0)
    index.believe(last)  # only the last stage holds it: only the last stage skips it
    point = index.resume_point(RequestId("q"), PROMPT)
    assert point.starts == (0, 0, 2 * B)
    assert point.keys == (None, None, last[1])


async def test_another_host_never_finds_the_pool_kept(source: ModelSource) -> None:
    """A worker keeps a stopped run's pool for its coordinator only: another host's claim
    frees it (its requests could otherwise probe which prompts the first host's served)."""
    old = _served(_build(source, _load()))
    sent: list[Message] = []

    async def send(peer: str, message: Message) -> None:
        sent.append(message)

    async def connect(info: PeerInfo) -> None:
        raise AssertionError("no Load here")

    async with trio.open_nursery() as nursery:
        worker = Worker(
            "w", send, connect=connect, backend=cpu_backend(), cache_dir=None, nursery=nursery
        )
        worker._kept = KeptPool(old.prefix, "host")
        claim = Claim(run_id="run-9", term=9, coordinator_id="host", package_ref="hf://test/tiny")
        await worker.handle("host", claim)
        assert worker._kept is not None  # the same host: kept for its next Load
        await worker.handle("other", dataclasses.replace(claim, coordinator_id="other"))
        assert isinstance(sent[-1], ClaimRejected)  # "host" holds the node ...
        worker.stop("test")  # ... until its run is gone
        await worker.handle("other", dataclasses.replace(claim, coordinator_id="other"))
        assert isinstance(sent[-1], ClaimAccepted)
        assert worker._kept is None
        nursery.cancel_scope.cancel()


def test_seeds_and_keys_are_checked_where_they_are_made() -> None:
    with pytest.raises(ValueError, match="prefix_seed"):
        _load(prefix_seed="not-a-seed")
    ready: dict[str, Any] = dict(run_id="r", term=1, node_id="n", endpoint="e", layer_range=(0, 1))
    with pytest.raises(ValueError, match="prefix_keys"):
        Ready(**ready, prefix_keys=("g" * 32,))
    with pytest.raises(ValueError, match="prefix_keys"):
        Ready(**ready, prefix_keys=("0" * 32,) * (MAX_READY_PREFIX_KEYS + 1))
    assert len(Ready(**ready, prefix_keys=("0" * 32,) * MAX_READY_PREFIX_KEYS).prefix_keys) == 1024
