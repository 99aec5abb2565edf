"""Streams outlive a stage that dies, stops or hangs (issue 16, "Requests survive").

Three real ``meshnode join`` processes on loopback serve SmolLM2-135M on three stages
(``--split 3``, f32 activations). The official ``openai`` client streams long completions,
one greedy and one with seeded sampling, at once; about 20 tokens in, the middle stage
fails, and each stream must complete without an error event, with the same token ids as
the same request served undisturbed (:func:`undisturbed`, before any fault). The faults,
in order, each on the mesh the one before left at three ready stages:

- the middle stage's process is killed (SIGKILL): its connection drops;
- it is stopped (SIGSTOP): the connection stays open and its heartbeats stop; after
  SIGCONT the plan grows back to three stages with the same node;
- it is stopped and goes on while a long stream runs: the host serves other requests on
  the smaller plan until no request is in flight, then grows back;
- eight clients at once (streamed and not, completions and chat, greedy and seeded) while
  the middle stage is killed: none loses its output, none hangs;
- its compute threads hang while its event loop and heartbeats go on (frozen by ptrace,
  :mod:`tests.e2e.freeze`): only the pass deadline (``--pass-deadline``) can notice; the
  host blames that node and leaves it out of the plans (cooling off). Runs last.

The host replans on the nodes left and replays the requests. Speculation is n-gram with a
fixed window, so the drafts (and with them the seeded draws) are the same in every run.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.e2e import freeze
from tests.e2e.cluster import (
    HEARTBEAT_ENV,
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    ready_stages,
    start_exact_mesh,
    wait_for,
    wait_started,
)

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
CONTEXT = 512
MAX_TOKENS = 160
KILL_AFTER_TOKENS = 20
READY_TIMEOUT_S = 120.0  # three processes load their layers on a shared 2-core box
STREAM_TIMEOUT_S = 240.0  # two 160-token streams, a replan and a replay, on that box
# The hang test's deadline: far above a pass here (tens of ms; a restarted worker's first
# pass loads its compiled kernels from numba's cache), so only the frozen stage misses it.
# With every core busy beside the suite a live stage was starved past 12 s (10 s + 0.25 s a
# token) between passes, and the mesh re-placed before the tests began.
PASS_DEADLINE_S = 30.0
# The whole vocabulary: a replay's logits (its KV computed in one chunk, not token by
# token) differ from the undisturbed run's in the last bits, which the exponential race
# shrugs off (meshnode.engine.sampling); inverse-CDF sampling, before it, picked a
# neighbouring tail id at token 140 of 160 in 3 runs of 4 without a nucleus.
SEEDED: dict[str, Any] = {"temperature": 0.8, "seed": 1234}
GREEDY: dict[str, Any] = {"temperature": 0.0}
CROWD = 8
LONG_TOKENS = 480  # seconds of decoding on one stage after the replay (the prompt has 13)
SERVES_TIMEOUT_S = 0.5  # a loop that answers does in milliseconds
CROWD_MAX_TOKENS = 48


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Node]]:
    root = tmp_path_factory.mktemp("replay")
    token = init_token(root / "mesh.token")
    with Cluster(root, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}) as cluster:
        host = start_exact_mesh(
            cluster,
            token,
            MODEL,
            "--speculative", "ngram",
            "--window-policy", "fixed",
            "--pass-deadline", str(PASS_DEADLINE_S),
            workers=2,
            ready_timeout_s=READY_TIMEOUT_S,
            context=CONTEXT,
        )  # fmt: skip
        yield cluster, host


class Stream:
    """One streamed completion: its token ids, when each chunk came, and how it ended."""

    def __init__(
        self,
        client: openai.OpenAI,
        prompt: list[int],
        sampling: dict[str, Any],
        max_tokens: int = MAX_TOKENS,
    ):
        self.tokens: list[int] = []
        self.arrivals: list[float] = []
        self.finish: str | None = None
        self.error: BaseException | None = None
        self._chunks = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"return_token_ids": True},
            **sampling,
        )

    def read(self, on_tokens: Any = None) -> None:
        try:
            for chunk in self._chunks:
                for choice in chunk.choices:
                    ids = (choice.model_extra or {}).get("token_ids") or []
                    if ids:
                        self.tokens += ids
                        self.arrivals.append(time.monotonic())
                    self.finish = choice.finish_reason or self.finish
                if on_tokens is not None:
                    on_tokens(len(self.tokens))
        except BaseException as exc:  # reported by the test's thread
            self.error = exc

    def longest_pause_s(self) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps, default=0.0)


def _client(host: Node) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=host.api + "/v1", api_key="x", max_retries=0, timeout=STREAM_TIMEOUT_S
    )


def _join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=STREAM_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a client hung"


def _streams(host: Node, prompt: list[int], on_tokens: Any = None) -> tuple[Stream, Stream]:
    """A greedy and a seeded stream of ``prompt`` at once, read to their end."""
    # Closed however it ends: a request refused while the mesh re-places would otherwise
    # leave the pool's socket to the garbage collector, failing a later test with its
    # ResourceWarning.
    with _client(host) as client:
        greedy, seeded = Stream(client, prompt, GREEDY), Stream(client, prompt, SEEDED)
        _join_all(
            [
                threading.Thread(target=greedy.read, args=(on_tokens,)),
                threading.Thread(target=seeded.read),
            ]
        )
    return greedy, seeded


@pytest.fixture
def client(mesh: tuple[Cluster, Node]) -> Iterator[openai.OpenAI]:
    """A client of the host, closed when the test ends (see :func:`_streams`)."""
    with _client(mesh[1]) as client:
        yield client


@pytest.fixture(scope="module")
def prompt(golden: dict[str, Any]) -> list[int]:
    return list(next(p["prompt_ids"] for p in golden["prompts"] if p["id"] == "raw_story"))


@pytest.fixture(scope="module")
def undisturbed(mesh: tuple[Cluster, Node], prompt: list[int]) -> tuple[Stream, Stream]:
    """The greedy and the seeded stream served with nothing going wrong."""
    greedy, seeded = _streams(mesh[1], prompt)
    assert greedy.error is None
    assert seeded.error is None
    assert len(greedy.tokens) > KILL_AFTER_TOKENS + 20
    assert len(seeded.tokens) > KILL_AFTER_TOKENS + 20
    return greedy, seeded


def _middle(cluster: Cluster, host: Node) -> Node:
    """The node of stage 1 (of three ready stages)."""
    ids = _three_stages(cluster, host)
    return next(n for n in cluster.nodes if n.alive() and n.node_id() == ids[1])


@pytest.fixture(autouse=True)
def three_stages_first(mesh: tuple[Cluster, Node]) -> None:
    """Every test starts on three ready stages, whatever the test before it left."""
    _three_stages(*mesh)


def _three_stages(cluster: Cluster, host: Node) -> list[str]:
    """Wait until the plan is three ready stages again; their node ids."""
    try:
        wait_for(lambda: ready_stages(host) == 3, READY_TIMEOUT_S, "three ready stages")
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{cluster.logs()}")
    return [stage["node_id"] for stage in host.status()["host"]["stages"]]


def _restart(cluster: Cluster, host: Node, node: Node) -> None:
    """Start ``node`` again (same state dir: the same identity), peered to the host, and
    wait until the plan has grown back to three stages with it."""
    node.process.wait(timeout=10)
    again = cluster.spawn(node.name, cluster.root / "mesh.token", "--peer", host.listen,
                          mdns=False)  # fmt: skip
    wait_started(again)
    assert again.node_id() in _three_stages(cluster, host)


def _when(count: int, act: Callable[[], None]) -> tuple[Callable[[int], None], list[float]]:
    """An ``on_tokens`` callback that runs ``act`` once, at ``count`` tokens; and the list
    that gets the time it ran."""
    done: list[float] = []

    def on_tokens(tokens: int) -> None:
        if tokens >= count and not done:
            act()
            done.append(time.monotonic())

    return on_tokens, done


def _assert_same(cluster: Cluster, got: tuple[Stream, Stream], want: tuple[Stream, Stream]) -> None:
    logs = cluster.logs()
    for stream in got:
        assert stream.error is None, f"{stream.error!r}\n{logs}"
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert [s.finish for s in got] == [s.finish for s in want]


def test_killing_the_middle_stage_mid_stream_loses_no_token(
    mesh: tuple[Cluster, Node], prompt: list[int], undisturbed: tuple[Stream, Stream]
) -> None:
    cluster, host = mesh
    stages = host.status()["host"]["stages"]
    middle = _middle(cluster, host)
    middle_id = middle.node_id()
    on_tokens, killed_at = _when(KILL_AFTER_TOKENS, middle.process.kill)
    greedy, seeded = _streams(host, prompt, on_tokens)
    assert killed_at, "the stream ended before the kill"
    _assert_same(cluster, (greedy, seeded), undisturbed)
    # Both requests were replayed on the plan made without the dead node.
    assert "replaying it (1 of 3)" in cluster.logs()
    after = host.status()["host"]["stages"]
    assert middle_id not in {s["node_id"] for s in after}
    print(
        f"\nstream paused at most {greedy.longest_pause_s():.2f} s (greedy) and "
        f"{seeded.longest_pause_s():.2f} s (seeded) across the kill; undisturbed at most "
        f"{undisturbed[0].longest_pause_s():.2f} s; {len(greedy.tokens)} tokens; stages "
        f"{[s['node_id'] for s in stages]} -> {[s['node_id'] for s in after]}"
    )
    _restart(cluster, host, middle)


def test_a_stopped_middle_stage_is_replaced_and_comes_back(
    mesh: tuple[Cluster, Node], prompt: list[int], undisturbed: tuple[Stream, Stream]
) -> None:
    """SIGSTOP: the stage's connection stays open and nothing it sends arrives. Its
    heartbeats stop, the host replays the streams on the nodes left; after SIGCONT the
    same process is back in a three-stage plan."""
    cluster, host = mesh
    middle = _middle(cluster, host)
    middle_id = middle.node_id()
    on_tokens, stopped_at = _when(
        KILL_AFTER_TOKENS, lambda: middle.process.send_signal(signal.SIGSTOP)
    )
    try:
        greedy, seeded = _streams(host, prompt, on_tokens)
        assert stopped_at, "the stream ended before the stop"
        _assert_same(cluster, (greedy, seeded), undisturbed)
        assert middle_id not in {s["node_id"] for s in host.status()["host"]["stages"]}
    finally:
        middle.process.send_signal(signal.SIGCONT)
    began = time.monotonic()
    assert middle_id in _three_stages(cluster, host)
    print(
        f"\nstream paused at most {greedy.longest_pause_s():.2f} s across the SIGSTOP; "
        f"three stages again {time.monotonic() - began:.1f} s after SIGCONT"
    )


def test_requests_are_served_while_a_stage_that_came_back_waits_to_rejoin(
    mesh: tuple[Cluster, Node], client: openai.OpenAI, prompt: list[int], golden: dict[str, Any]
) -> None:
    """The middle stage stops (SIGSTOP) 20 tokens into a long stream and goes on (SIGCONT)
    once the host serves on the nodes left. The plan would grow back, but the stream is
    still in flight: the host keeps serving on the smaller plan, so a request sent now is
    answered (not told 503), and re-places the model once no request is in flight."""
    cluster, host = mesh
    middle = _middle(cluster, host)
    middle_id = middle.node_id()
    long = Stream(client, prompt, GREEDY, max_tokens=LONG_TOKENS)
    on_tokens, stopped_at = _when(
        KILL_AFTER_TOKENS, lambda: middle.process.send_signal(signal.SIGSTOP)
    )
    reader = threading.Thread(target=long.read, args=(on_tokens,))
    reader.start()
    try:
        wait_for(lambda: bool(stopped_at), STREAM_TIMEOUT_S, "the stop")
        # Serving again, on the nodes left (not merely re-placing: a request sent while the
        # smaller plan still loads is told 503, as it should be).
        wait_for(lambda: _serving_without(host, middle_id), READY_TIMEOUT_S, "the replan")
    finally:
        middle.process.send_signal(signal.SIGCONT)
    wait_for(lambda: host.peer_states()[middle_id] == "alive", READY_TIMEOUT_S, "it back")
    if not reader.is_alive():
        pytest.skip("the long stream ended before the stopped node was back (fast machine)")
    case = golden["prompts"][0]
    try:
        reply = client.completions.create(
            model=MODEL, prompt=case["prompt_ids"], temperature=0, max_tokens=len(case["gen_ids"])
        )
    except openai.APIStatusError as exc:
        # The long stream may end between the check above and this request: then the host
        # re-places at once (nothing in flight) and answers 503 while the plan loads, as it
        # should. Only a 503 while the stream is still in flight is this test's failure.
        reader.join(SERVES_TIMEOUT_S * 20)
        if exc.status_code != 503 or reader.is_alive() or long.error is not None:
            state = "in flight" if reader.is_alive() else f"ended ({long.error!r})"
            pytest.fail(f"{exc!r} while the long stream was {state}\n{cluster.logs()}")
        _three_stages(cluster, host)
        pytest.skip("the long stream ended just before the request (fast machine)")
    assert reply.choices[0].text == case["gen_text_skip_special"]
    reader.join(STREAM_TIMEOUT_S)
    assert not reader.is_alive(), "the long stream hung"
    assert long.error is None, f"{long.error!r}\n{cluster.logs()}"
    assert middle_id in _three_stages(cluster, host)
    assert "re-placing between requests" in host.log() or "draining" in host.log()


def _serving_without(host: Node, node_id: str) -> bool:
    """Whether the host serves on a plan that leaves ``node_id`` out."""
    ids = _ready_ids(host)
    return bool(ids) and node_id not in ids


def _ready_ids(host: Node) -> list[str]:
    """The node ids of the host's plan while it serves (none while it does not)."""
    block = host.status()["host"]
    return [s["node_id"] for s in block["stages"]] if block["state"] == "ready" else []


def test_eight_clients_outlive_a_stage_killed_under_them(
    mesh: tuple[Cluster, Node], client: openai.OpenAI, golden: dict[str, Any]
) -> None:
    """Eight requests at once (streamed and not, completions and chat, greedy and seeded)
    while the middle stage is killed: each gets the reply it gets undisturbed, no error,
    and no client hangs."""
    cluster, host = mesh
    cases = [golden["prompts"][i % len(golden["prompts"])] for i in range(CROWD)]

    def ask(i: int, on_tokens: Callable[[int], None] | None, out: dict[int, Any]) -> None:
        sampling: dict[str, Any] = GREEDY if i % 2 == 0 else {**SEEDED, "seed": 100 + i}
        try:
            if i % 4 == 3:  # a chat completion, not streamed
                reply = client.chat.completions.create(
                    model=MODEL, max_tokens=CROWD_MAX_TOKENS, **sampling,
                    messages=[{"role": "user", "content": cases[i]["prompt_text"]}],
                )  # fmt: skip
                out[i] = ("text", reply.choices[0].message.content)
                return
            tokens: list[int] = []
            for chunk in client.completions.create(
                model=MODEL, prompt=cases[i]["prompt_ids"], max_tokens=CROWD_MAX_TOKENS,
                stream=True, extra_body={"return_token_ids": True}, **sampling,
            ):  # fmt: skip
                for choice in chunk.choices:
                    tokens += (choice.model_extra or {}).get("token_ids") or []
                if on_tokens is not None:
                    on_tokens(len(tokens))
            out[i] = ("tokens", tokens)
        except BaseException as exc:  # reported below
            out[i] = ("error", repr(exc))

    def crowd(on_tokens: Callable[[int], None] | None) -> dict[int, Any]:
        out: dict[int, Any] = {}
        _join_all(
            [
                threading.Thread(target=ask, args=(i, on_tokens if i == 0 else None, out))
                for i in range(CROWD)
            ]
        )
        return out

    calm = crowd(None)
    assert all(kind != "error" for kind, _ in calm.values()), calm
    middle = _middle(cluster, host)
    on_tokens, killed_at = _when(8, middle.process.kill)
    disturbed = crowd(on_tokens)
    assert killed_at, "the requests ended before the kill"
    assert disturbed == calm, cluster.logs()
    _restart(cluster, host, middle)


def test_a_hung_stage_misses_its_pass_deadline_and_cools_off(
    mesh: tuple[Cluster, Node], prompt: list[int], undisturbed: tuple[Stream, Stream]
) -> None:
    """The middle stage's compute threads freeze while its event loop goes on (it answers
    its API, its heartbeats flow, its session stays up): the pass misses its deadline, the
    host blames that node, plans without it, and replays the streams. Runs last: the node
    stays out of the plans for minutes (cooling off)."""
    cluster, host = mesh
    middle = _middle(cluster, host)
    middle_id = middle.node_id()
    freezer, serves = freeze.freezer_of(middle, SERVES_TIMEOUT_S)

    def hang() -> None:
        freezer.freeze(serves)

    on_tokens, hung_at = _when(KILL_AFTER_TOKENS, hang)
    try:
        greedy, seeded = _streams(host, prompt, on_tokens)
        assert hung_at, "the stream ended before the hang"
        # Alive all along: only the deadline can have found it.
        assert host.peer_states()[middle_id] == "alive"
    finally:
        freezer.close()
    _assert_same(cluster, (greedy, seeded), undisturbed)
    logs = cluster.logs()
    assert "a pass did not come back within" in logs, logs
    assert f"blamed: {middle_id}" in logs, logs
    assert greedy.longest_pause_s() >= PASS_DEADLINE_S
    block = host.status()["host"]
    assert middle_id in block["cooling_off"]
    assert middle_id not in {s["node_id"] for s in block["stages"]}
    print(f"\nstream paused at most {greedy.longest_pause_s():.2f} s across the hang")
