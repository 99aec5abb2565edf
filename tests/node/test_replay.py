"""Requests outlive stage failures: a lost stage is replaced and the request replayed.

The coordinator, the workers and the serving service's generation loop are real (the
workers are tests/node/inmemory.py's, fetching a tiny model from a loopback hub); only the
transport is in memory (every message through the wire codec on its way).

A stage is "killed" as a dead process would be: its worker drops its run, every message to
it fails, and the host's session with it ends (``Coordinator.peer_lost``). Each replayed
stream must equal the same request's undisturbed run, token for token: greedy, seeded
sampling, with speculation, and several streams batched together.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast

import pytest
import trio
from meshnode_packaging.refs import open_ref

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import BatchRow
from meshnode.engine.sampling import SamplingParams
from meshnode.generation import replay
from meshnode.generation.records import GenerationRun, Speculation
from meshnode.generation.replay import MAX_REPLAYS
from meshnode.generation.state import GenerationParams, GenerationState
from meshnode.node import coordinator
from meshnode.node.coordinator import Coordinator
from meshnode.node.decisions import blame
from meshnode.node.footprint import model_footprint
from meshnode.node.mesh import CoordinatorSettings
from meshnode.node.pipeline import RequestId, StageLostError
from meshnode.node.remote import PassDeadline, RemotePipeline
from meshnode.serve.service import ServeService, TextCodec
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.window import WindowPolicy
from tests.node.inmemory import HOST, InMemoryMesh, add_worker
from tests.node.test_constraint import GRAMMAR

CONTEXT = 96
TOKENS = 24
PROMPTS = [(1, 5, 9, 14, 3), (7, 7, 2), (30, 31, 32, 30, 31, 32, 30), (11, 12)]
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=20261123)
# No truncation: the race runs over the whole vocabulary, whose float noise after a replay
# moved inverse-CDF sampling's pick (meshnode.engine.sampling).
FULL_VOCAB = SamplingParams(temperature=0.8, top_p=1.0, seed=20261123)
BRING_UP_TIMEOUT_S = 60.0
TEST_TIMEOUT_S = 120.0  # each test: several bring-ups of a tiny model on a loaded box


class SilentDetokenizer:
    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class Host:
    """The host: a coordinator whose pipelines the serving service runs requests on."""

    def __init__(
        self,
        mesh: InMemoryMesh,
        package: Path,
        ref: str,
        *,
        split: int,
        speculation: Speculation | None = None,
        deadline: PassDeadline | None = None,
        place_by_speed: bool = True,
    ) -> None:
        # The service's codec is never asked for anything here: runs are built by the test.
        self.service = ServeService(
            model_id="tiny",
            codec=cast(TextCodec, object()),
            context_size=CONTEXT,
            eos_token_ids=frozenset(),
            speculation=speculation,
        )
        self.pipelines: list[RemotePipeline] = []
        self._announced = trio.Event()
        settings = CoordinatorSettings(
            model_ref=ref,
            context_size=CONTEXT,
            split=split,
            wire_dtype="f32",
            pass_deadline=deadline or PassDeadline(),
            place_by_speed=place_by_speed,
        )
        self.coordinator = Coordinator(
            mesh,
            settings,
            source=open_ref(package),
            backend=cpu_backend(),
            on_pipeline=self._on_pipeline,
        )
        mesh.coordinator = self.coordinator

    def _on_pipeline(self, pipeline: RemotePipeline | None) -> None:
        self.service.set_pipeline(pipeline)
        if pipeline is not None:
            self.pipelines.append(pipeline)
            self._announced.set()
            self._announced = trio.Event()

    async def ready(self, count: int = 1) -> RemotePipeline:
        """The ``count``-th pipeline, once brought up."""
        with trio.fail_after(BRING_UP_TIMEOUT_S):
            while len(self.pipelines) < count:
                await self._announced.wait()
        return self.pipelines[count - 1]

    async def stream(
        self,
        request: str,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        on_tokens: Callable[[int], Awaitable[None]] | None = None,
        grammar: str | None = None,
        *,
        cache: bool = True,
    ) -> tuple[list[int], GenerationRun]:
        """One request through the service's generation loop: its tokens and its run
        (``cache``: its ``cache_prompt``)."""
        params = GenerationParams(
            max_new_tokens=TOKENS, sampling=sampling, grammar=grammar, cache_prompt=cache
        )
        state = GenerationState(params, SilentDetokenizer())
        run = GenerationRun(RequestId(request), list(prompt), params, state)
        tokens: list[int] = []
        async with aclosing(self.service.stream(run)) as deltas:
            async for delta in deltas:
                tokens += delta.tokens
                if on_tokens is not None:
                    await on_tokens(len(tokens))
        return tokens, run


def kill(mesh: InMemoryMesh, node: str) -> None:
    """``node``'s process dies: its run goes, messages to it fail, its sessions end."""
    worker = mesh.workers.pop(node)
    worker.peer_lost(HOST)  # with the host gone from its view, it drops its run
    assert mesh.coordinator is not None
    mesh.coordinator.peer_lost(node)
    mesh.changed()


def start(
    mesh: InMemoryMesh, tmp_path: Path, nursery: trio.Nursery, host: Host, workers: list[str]
) -> None:
    for node in workers:
        add_worker(mesh, node, tmp_path / f"{node}-cache", nursery)
    nursery.start_soon(host.coordinator.run)


@pytest.mark.parametrize(
    ("sampling", "speculate"),
    [(GREEDY, False), (SEEDED, False), (FULL_VOCAB, False), (GREEDY, True), (FULL_VOCAB, True)],
    ids=["greedy", "seeded", "seeded-full-vocabulary", "greedy-ngram", "seeded-ngram"],
)
async def test_a_stage_lost_mid_stream_is_replayed_exactly(
    tmp_path: Path, hub_ref: tuple[str, Path], sampling: SamplingParams, speculate: bool
) -> None:
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    speculation = None
    if speculate:  # a fixed window: the drafts, hence the passes, are the same every run
        policy = WindowPolicy(kind="fixed", initial_window=3, max_window=3)
        speculation = Speculation(lambda p, c: NgramProposer(), policy, strategy="ngram")
    host = Host(mesh, package, ref, split=3, speculation=speculation)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a", "b", "spare"])
            first = await host.ready()
            assert first.stage_nodes == (HOST, "a", "b")
            undisturbed, _ = await host.stream("calm", PROMPTS[2], sampling)

            async def kill_the_middle_stage(produced: int) -> None:
                if produced >= 6 and "a" in mesh.workers:
                    kill(mesh, "a")

            replayed, run = await host.stream(
                "stormy", PROMPTS[2], sampling, on_tokens=kill_the_middle_stage
            )
            assert replayed == undisturbed
            assert len(replayed) == TOKENS
            assert run.replays == 1
            assert "meshnode_replays_total 1\n" in host.service.metrics.render()
            assert first.failure is not None
            assert first.failure.node == "a"
            second = await host.ready(2)
            assert second.stage_nodes == (HOST, "b", "spare")
            assert host.service.open_runs == 0
            nursery.cancel_scope.cancel()


async def test_concurrent_streams_are_all_replayed_exactly(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """Several batched streams (greedy and seeded) lose the last stage at once; each goes
    on to the same tokens as its undisturbed run."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=3)
    samplings = [GREEDY, SEEDED, GREEDY, SEEDED]
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a", "b", "spare"])
            await host.ready()
            undisturbed = [
                (await host.stream(f"calm{i}", p, s))[0]
                for i, (p, s) in enumerate(zip(PROMPTS, samplings, strict=True))
            ]
            outputs: list[list[int]] = [[] for _ in PROMPTS]
            runs: list[GenerationRun | None] = [None] * len(PROMPTS)

            async def kill_the_last_stage(produced: int) -> None:
                if produced >= 8 and "b" in mesh.workers:
                    kill(mesh, "b")

            async def one(i: int) -> None:
                hook = kill_the_last_stage if i == 0 else None
                outputs[i], runs[i] = await host.stream(
                    f"stormy{i}", PROMPTS[i], samplings[i], on_tokens=hook
                )

            async with trio.open_nursery() as streams:
                for i in range(len(PROMPTS)):
                    streams.start_soon(one, i)
            assert outputs == undisturbed
            # Every stream was in flight when the stage died: each was replayed once.
            assert [r.replays if r else None for r in runs] == [1] * len(PROMPTS)
            assert (await host.ready(2)).stage_nodes == (HOST, "a", "spare")
            nursery.cancel_scope.cancel()


async def test_a_request_gives_up_after_max_replays(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """Every pipeline loses its stage as soon as the request is on it: after MAX_REPLAYS
    replays the stream ends with the error, and its sequence is released."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=2)
    workers = [f"w{i}" for i in range(MAX_REPLAYS + 2)]
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, workers)
            await host.ready()
            produced: list[int] = []

            async def kill_the_stage(count: int) -> None:
                produced.append(count)
                kill(mesh, host.pipelines[0].stage_nodes[1])

            async def killer() -> None:  # every later pipeline dies once it is up
                for n in range(2, MAX_REPLAYS + 2):
                    pipeline = await host.ready(n)
                    kill(mesh, pipeline.stage_nodes[1])

            nursery.start_soon(killer)
            with pytest.raises(StageLostError, match="was lost"):
                await host.stream("doomed", PROMPTS[0], GREEDY, on_tokens=kill_the_stage)
            assert produced == [1]  # the first token came, then no pipeline lasted
            failed = [p for p in host.pipelines if p.failure is not None]
            assert len(failed) == MAX_REPLAYS + 1
            assert host.service.open_runs == 0
            nursery.cancel_scope.cancel()


class HangingForward:
    """The real engine stage of one worker, whose forward blocks while ``hang`` is set
    (a stage that hangs in compute while its session, heartbeats included, goes on)."""

    def __init__(self, stage: Any) -> None:
        self.inner = stage
        self.hang = threading.Event()
        self.released = threading.Event()
        self.returned = threading.Event()  # a hung forward came back (after ``released``)
        self.hung = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, items: list[BatchRow]) -> list[Any]:
        if self.hang.is_set():
            self.hung += 1
            self.released.wait()
            self.returned.set()
        return cast(list[Any], self.inner.forward_batch(items))


async def test_a_stage_that_hangs_misses_its_deadline_and_is_blamed(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """The middle stage hangs in a forward; nothing else is wrong with it (its session is
    up). The pass misses its deadline, the probe blames the hung node, the next plan leaves
    it out (cooling off), and the stream goes on to the undisturbed run's tokens."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    deadline = PassDeadline(base_s=3.0, per_token_s=0.0)
    host = Host(mesh, package, ref, split=3, deadline=deadline)
    hanging: HangingForward | None = None
    try:
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                start(mesh, tmp_path, nursery, host, ["a", "b", "spare"])
                await host.ready()
                undisturbed, _ = await host.stream("calm", PROMPTS[0], GREEDY)
                run_a = mesh.workers["a"].run
                assert run_a is not None
                assert run_a.runner is not None
                hanging = HangingForward(run_a.runner.stage)
                run_a.runner.stage = cast(Any, hanging)
                began = 0.0

                async def hang_the_middle_stage(produced: int) -> None:
                    nonlocal began
                    if produced == 5 and hanging is not None:
                        hanging.hang.set()
                        began = trio.current_time()

                replayed, run = await host.stream(
                    "stuck", PROMPTS[0], GREEDY, on_tokens=hang_the_middle_stage
                )
                assert replayed == undisturbed
                assert run.replays == 1
                assert hanging.hung == 1
                first = host.pipelines[0]
                assert first.failure is not None
                assert "did not come back within 3 s" in str(first.failure)
                assert first.failure.node == "a"  # blamed by the probe
                assert trio.current_time() - began >= deadline.base_s
                assert host.pipelines[1].stage_nodes == (HOST, "b", "spare")
                status = host.coordinator.status()
                assert set(status["cooling_off"]) == {"a"}
                assert "a" in mesh.workers  # it never left the mesh
                hanging.released.set()
                nursery.cancel_scope.cancel()
    finally:
        if hanging is not None:
            hanging.released.set()  # the hung thread ends, whatever failed


@pytest.mark.parametrize("split", [3, 1], ids=["three-stages", "host-alone"])
async def test_a_hung_stage_0_fails_over_to_a_fresh_one(
    tmp_path: Path, hub_ref: tuple[str, Path], split: int
) -> None:
    """The host's own stage hangs in a forward. No probe can blame it and no plan can leave
    it out: its compute misses the pass deadline, the pipeline fails naming the host (not
    excluded, not cooled off), the next run brings up a fresh stage 0, and the stream goes
    on to the undisturbed run's tokens while the hung thread is left behind. Alone, the
    host's stage is the whole model (it samples too): the same holds."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    deadline = PassDeadline(base_s=3.0, per_token_s=0.0)
    host = Host(mesh, package, ref, split=split, deadline=deadline)
    hanging: HangingForward | None = None
    try:
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                start(mesh, tmp_path, nursery, host, ["a", "b", "spare"][: split - 1])
                first = await host.ready()
                undisturbed, _ = await host.stream("calm", PROMPTS[0], GREEDY)
                hanging = HangingForward(first.runner.stage)
                first.runner.stage = cast(Any, hanging)
                began = failed_at = math.inf

                async def note_the_failure() -> None:
                    nonlocal failed_at
                    await first.failed.wait()
                    failed_at = trio.current_time()

                async def hang_stage_0(produced: int) -> None:
                    nonlocal began
                    if produced == 5 and hanging is not None:
                        hanging.hang.set()
                        began = trio.current_time()

                nursery.start_soon(note_the_failure)
                replayed, run = await host.stream(
                    "stuck", PROMPTS[0], GREEDY, on_tokens=hang_stage_0
                )
                assert replayed == undisturbed
                assert run.replays == 1
                assert hanging.hung == 1
                assert first.failure is not None
                assert f"stage 0 on this node ({HOST}) did not finish a pass within 3 s" in str(
                    first.failure
                )
                assert first.failure.node == HOST
                # On the deadline, with no probe's wait after it.
                assert deadline.base_s <= failed_at - began < deadline.base_s + 2
                assert first.stage0_hung  # its thread is still in the forward
                second = host.pipelines[1]
                assert second.stage_nodes[0] == HOST
                assert len(second.stage_nodes) == split
                assert second.runner is not first.runner
                assert host.coordinator.status()["cooling_off"] == {}
                hanging.released.set()  # the abandoned thread ends
                assert await trio.to_thread.run_sync(hanging.returned.wait, 10.0)
                nursery.cancel_scope.cancel()
    finally:
        if hanging is not None:
            hanging.released.set()


class HangingHost(Host):
    """A host whose every new pipeline's stage 0 hangs in its first forward (while
    ``hang_new``): a stage 0 that hangs on every run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.hang_new = True
        self.hangs: list[HangingForward] = []
        super().__init__(*args, **kwargs)

    def _on_pipeline(self, pipeline: RemotePipeline | None) -> None:
        if pipeline is not None and self.hang_new:
            hanging = HangingForward(pipeline.runner.stage)
            hanging.hang.set()
            pipeline.runner.stage = cast(Any, hanging)
            self.hangs.append(hanging)
        super()._on_pipeline(pipeline)


async def test_a_stage_0_that_hangs_on_every_run_fails_its_requests_in_bounded_time(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 0 hangs on every run. The request fails over to a fresh stage 0 once, which
    hangs too; with MAX_HUNG_STAGE0 stage-0 threads hung, the coordinator brings up no
    other run (its status says why), and the request fails with an error naming stage 0
    once its wait for a pipeline ends (REPLAY_WAIT_S, shortened here). When the hung
    forwards return, serving resumes."""
    ref, package = hub_ref
    monkeypatch.setattr(replay, "REPLAY_WAIT_S", 5.0)
    mesh = InMemoryMesh(host_memory=1 << 34)
    deadline = PassDeadline(base_s=2.0, per_token_s=0.0)
    host = HangingHost(mesh, package, ref, split=2, deadline=deadline)
    try:
        with trio.fail_after(TEST_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                start(mesh, tmp_path, nursery, host, ["a"])
                await host.ready()
                began = trio.current_time()
                with pytest.raises(StageLostError) as lost:
                    await host.stream("doomed", PROMPTS[0], GREEDY)
                took = trio.current_time() - began
                message = str(lost.value)
                assert f"stage 0 on this node ({HOST}) did not finish a pass within 2 s" in message
                assert "no pipeline came back within 5 s" in message
                # Two deadlines, one bring-up and the wait for a pipeline, with room for
                # a bring-up on a loaded box: bounded, not a hang.
                assert took < 2 * deadline.base_s + 5.0 + BRING_UP_TIMEOUT_S
                assert len(host.pipelines) == coordinator.MAX_HUNG_STAGE0
                assert all(p.stage0_hung for p in host.pipelines)
                status = host.coordinator.status()
                assert status["state"] == "failed"
                assert "stage 0 on this node hangs: 2 of its passes" in status["error"]
                assert status["cooling_off"] == {}
                host.hang_new = False
                for hanging in host.hangs:
                    hanging.released.set()
                await host.ready(coordinator.MAX_HUNG_STAGE0 + 1)  # serving resumes
                tokens, _ = await host.stream("after", PROMPTS[0], GREEDY)
                assert len(tokens) == TOKENS
                nursery.cancel_scope.cancel()
    finally:
        for hanging in host.hangs:
            hanging.released.set()


async def test_a_refusal_relayed_by_the_middle_stage_fails_over_at_once(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """The last stage drops its run while its session stays up (as a node that restarted
    its worker would): it refuses the next batched step frame by frame, the middle stage
    passes each refusal on to the host, and the host fails over at once (no deadline: the
    default is 60 s) and blames the last stage, which the probe finds without the run."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=3)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a", "b", "spare"])
            first = await host.ready()
            undisturbed = [
                (await host.stream(f"calm{i}", p, GREEDY))[0] for i, p in enumerate(PROMPTS)
            ]
            outputs: list[list[int]] = [[] for _ in PROMPTS]
            dropped_at = failed_at = math.inf

            async def note_the_failure() -> None:
                nonlocal failed_at
                await first.failed.wait()
                failed_at = trio.current_time()

            async def drop_the_run(produced: int) -> None:
                nonlocal dropped_at
                worker = mesh.workers["b"]
                if produced == 4 and worker.run is not None:
                    dropped_at = trio.current_time()
                    worker.peer_lost(HOST)  # its claim goes; the session does not

            async def one(i: int) -> None:
                hook = drop_the_run if i == 0 else None
                outputs[i], _ = await host.stream(f"stormy{i}", PROMPTS[i], GREEDY, on_tokens=hook)

            nursery.start_soon(note_the_failure)
            async with trio.open_nursery() as streams:
                for i in range(len(PROMPTS)):
                    streams.start_soon(one, i)
            assert outputs == undisturbed
            # Failed over on the refusal, not on the pass deadline (the replays after it
            # may take a while on a busy machine; they are not what is timed).
            assert failed_at - dropped_at < first.deadline.base_s / 2
            assert first.failure is not None
            assert "no longer runs this pipeline" in str(first.failure)
            assert first.failure.node == "b"
            assert (await host.ready(2)).stage_nodes == (HOST, "a", "spare")
            assert set(host.coordinator.status()["cooling_off"]) == {"b"}
            nursery.cancel_scope.cancel()


async def test_a_request_gives_up_when_no_plan_fits_in_time(
    tmp_path: Path, hub_ref: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host holds half the model: with its only worker dead nothing can be placed, and
    the replay's wait for a pipeline ends with the error (REPLAY_WAIT_S, shortened here)."""
    ref, package = hub_ref
    config = ModelConfig.from_hf(open_ref(package).config)
    footprint = model_footprint(config)
    whole = sum(footprint.layer_bytes) + footprint.embed_bytes * 2 + footprint.head_bytes
    whole += footprint.kv_bytes_per_token_per_layer * config.num_layers * CONTEXT
    monkeypatch.setattr(replay, "REPLAY_WAIT_S", 1.0)
    mesh = InMemoryMesh(host_memory=whole // 2)
    host = Host(mesh, package, ref, split=2)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["only"])
            await host.ready()

            async def kill_the_worker(produced: int) -> None:
                if "only" in mesh.workers:
                    kill(mesh, "only")

            with pytest.raises(StageLostError, match="no pipeline came back within 1 s"):
                await host.stream("stranded", PROMPTS[0], GREEDY, on_tokens=kill_the_worker)
            assert host.service.open_runs == 0
            assert host.coordinator.status()["state"] == "planning"
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("answers", "blamed"),
    [
        ({"a": 0, "b": 0}, None),  # nobody computes: the pass was lost without a trace
        ({"a": 0, "b": 90_000}, "b"),  # b has computed one pass for 90 s
        ({"a": 10, "b": 20}, None),  # short passes in progress blame nobody
        ({"a": None, "b": 90_000}, "a"),  # a silent (or runless) stage comes first
        ({"a": 0, "b": None}, "b"),
        ({"a": 40_000, "b": 80_000}, "b"),  # the oldest pass in progress
    ],
)
def test_blame_rule(answers: dict[str, int | None], blamed: str | None) -> None:
    assert blame(("a", "b"), answers, min_busy_ms=30_000) == blamed


async def test_a_constrained_request_is_replayed_under_its_grammar(
    tmp_path: Path, hub_ref: tuple[str, Path]
) -> None:
    """The last stage, which enforces the request's grammar, dies mid-reply: the new last
    stage gets the grammar with the replayed prompt, follows the committed tokens, and
    the reply goes on to the undisturbed run's tokens (seeded sampling under the mask)."""
    ref, package = hub_ref
    mesh = InMemoryMesh(host_memory=1 << 34)
    host = Host(mesh, package, ref, split=3)
    with trio.fail_after(TEST_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            start(mesh, tmp_path, nursery, host, ["a", "b", "spare"])
            await host.ready()
            undisturbed, _ = await host.stream("calm", PROMPTS[0], SEEDED, grammar=GRAMMAR)

            async def kill_the_last_stage(produced: int) -> None:
                if produced >= 6 and "b" in mesh.workers:
                    kill(mesh, "b")

            replayed, run = await host.stream(
                "stormy", PROMPTS[0], SEEDED, on_tokens=kill_the_last_stage, grammar=GRAMMAR
            )
            assert replayed == undisturbed
            assert run.replays == 1
            assert host.pipelines[1].stage_nodes == (HOST, "a", "spare")
            nursery.cancel_scope.cancel()
