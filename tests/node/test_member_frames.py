"""A member's frames whose ids or shapes do not fit the model (issue 15, item 9).

Over a real TLS session, the test coordinates a run on a live node (the real daemon in this
process, its stage fetched from a loopback hub) and sends it activation frames carrying
token ids past the vocabulary, out-of-range drafts or activations of the wrong width.
Each fails only its request, with a ``BAD_ACTIVATION`` error naming it: no exception
inside the node (before, an id past the embedding raised ``IndexError`` in NumPy, the
request got no answer at all and the host waited on it), no closed session, and the next
well-formed frame is served.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from meshnode_protocol import ActivationFrame, Error, ErrorCode, Message, Prediction

from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.net.identity import JoinToken, NodeIdentity
from meshnode.node.pipeline import FrameKind, PipelineError, RequestId, StepFrame
from meshnode.node.remote import RemotePipeline
from meshnode.node.stage import StageRunner
from tests.engine.tiny import CONFIG, vocabulary
from tests.node.member import Member, activation, start_node
from tests.speculative.tinymodel import TinySource, tiny_config

VOCAB = len(vocabulary())
HIDDEN = int(CONFIG["hidden_size"])
LAYERS = int(CONFIG["num_hidden_layers"])
RUN, TERM = "run-fuzzed", 3
CONTEXT = 64


def _bad_frames(hidden: int | None) -> list[tuple[str, ActivationFrame]]:
    def frame(name: str, **kwargs: object) -> tuple[str, ActivationFrame]:
        args: dict[str, object] = {"run_id": RUN, "term": TERM, "hidden_size": hidden}
        return name, activation(request_id=name, **(args | kwargs))  # type: ignore[arg-type]

    frames = [
        frame("past-the-vocab", tokens=(1, VOCAB)),
        frame("far-past", tokens=(2**32 - 1,)),
        frame("bad-draft", tokens=(1,), drafts=(3, VOCAB + 7)),
    ]
    if hidden is not None:
        frames.append(frame("wrong-width", tokens=(1, 2), hidden_size=hidden + 8))
    return frames


@pytest.mark.parametrize("embeds", [False, True], ids=["middle-and-last", "whole-model"])
async def test_out_of_range_ids_fail_only_their_request(
    nursery: trio.Nursery, hub_ref: tuple[str, Path], tmp_path: Path, embeds: bool
) -> None:
    ref, _package = hub_ref
    token = JoinToken.generate("m")
    node = await start_node(nursery, token, tmp_path / "node", tmp_path / "cache")
    assert node.listen is not None
    member = await Member.dial(NodeIdentity.provision(token, tmp_path / "me"), node.listen)
    layers = (0, LAYERS) if embeds else (1, LAYERS)
    await member.bring_up(
        node.node_id, run_id=RUN, term=TERM, ref=ref, layers=layers, embed=embeds,
        context=CONTEXT,
    )  # fmt: skip
    hidden = None if embeds else HIDDEN
    for name, frame in _bad_frames(hidden):
        await member.send(frame)
        reply = await member.receive(Error, Prediction)
        assert isinstance(reply, Error), name
        assert reply.code == ErrorCode.BAD_ACTIVATION, name
        assert reply.request_id == name
        assert "outside 0.." in reply.message or "shape" in reply.message, reply.message
    good = activation(
        request_id="fine", run_id=RUN, term=TERM, tokens=(1, 5, 9), hidden_size=hidden
    )
    await member.send(good)
    answer = await member.receive(Error, Prediction)
    assert isinstance(answer, Prediction), answer
    assert answer.request_id == "fine"
    assert all(0 <= t < VOCAB for t in answer.tokens)
    status = node.status()["node"]
    assert status["internal_errors"] == 0
    assert status["protocol_errors"] == 0
    assert not member.closed
    await member.aclose()


@pytest.mark.parametrize(
    ("tokens", "accepted", "drafts"),
    [((VOCAB,), 0, ()), ((1,), 0, (VOCAB + 3,)), ((1, 2**32 - 1), 1, ())],
    ids=["token-past-the-vocab", "draft-past-the-vocab", "far-past-the-vocab"],
)
async def test_the_host_refuses_a_prediction_that_does_not_fit(
    tokens: tuple[int, ...], accepted: int, drafts: tuple[int, ...]
) -> None:
    """The last stage's ids become the host's next input (and its detokenizer's): one that
    does not fit fails that request with a PipelineError, never an IndexError later."""
    source = TinySource(tiny_config(VOCAB, 2), seed=0, logit_scale=8.0)
    stage0 = Stage(ModelConfig.from_hf(source.config), source, 0, 1, embed=True, head=False)
    sent: list[Message] = []
    forwarded = trio.Event()

    async def send(peer: str, message: Message) -> None:
        sent.append(message)
        forwarded.set()

    pipeline = RemotePipeline(
        StageRunner(stage0, context_size=32, max_sequences=1),
        run_id=RUN, term=TERM, stage_nodes=("host", "last"), send=send, wire_dtype="f32",
    )  # fmt: skip
    frame = StepFrame(RequestId("req"), FrameKind.PREFILL, 0, (1, 2), SamplingParams(0.0))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            reply = (tokens, accepted, drafts)
            nursery.start_soon(_deliver_after_send, pipeline, forwarded, sent, reply)
            with pytest.raises(PipelineError, match="bad Prediction"):
                await pipeline.run(frame)


async def _deliver_after_send(
    pipeline: RemotePipeline,
    forwarded: trio.Event,
    sent: list[Message],
    reply: tuple[tuple[int, ...], int, tuple[int, ...]],
) -> None:
    tokens, accepted, drafts = reply
    await forwarded.wait()
    wire = sent[-1]
    assert isinstance(wire, ActivationFrame)
    prediction = Prediction(
        request_id=wire.request_id, run_id=RUN, term=TERM, start_pos=2, accepted=accepted,
        tokens=tokens, drafts=drafts,
    )  # fmt: skip
    pipeline.deliver("last", prediction)


async def test_a_members_stage_times_are_cut_to_the_runs_stages() -> None:
    """Each entry of ``stage_compute_us`` becomes a ``stage_seconds`` series on the host: a
    member that sends 5,000 of them gets as many as the run has stages (issue 36, item 10)."""
    source = TinySource(tiny_config(VOCAB, 2), seed=0, logit_scale=8.0)
    stage0 = Stage(ModelConfig.from_hf(source.config), source, 0, 1, embed=True, head=False)
    sent: list[Message] = []
    forwarded = trio.Event()

    async def send(peer: str, message: Message) -> None:
        sent.append(message)
        forwarded.set()

    pipeline = RemotePipeline(
        StageRunner(stage0, context_size=32, max_sequences=1),
        run_id=RUN, term=TERM, stage_nodes=("host", "middle", "last"), send=send,
        wire_dtype="f32",
    )  # fmt: skip

    async def deliver() -> None:
        await forwarded.wait()
        wire = sent[-1]
        assert isinstance(wire, ActivationFrame)
        prediction = Prediction(
            request_id=wire.request_id, run_id=RUN, term=TERM, start_pos=2, accepted=0,
            tokens=(1,), compute_us=7, stage_compute_us=tuple(range(5_000)),
        )  # fmt: skip
        pipeline.deliver("last", prediction)

    frame = StepFrame(RequestId("req"), FrameKind.PREFILL, 0, (1, 2), SamplingParams(0.0))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            result = await pipeline.run(frame)
    assert len(result.stage_compute_s) == 3
    assert result.stage_compute_s[1:] == (0.0, 1e-6)
