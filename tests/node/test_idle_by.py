"""When the host may re-place the model between requests (``remote.idle_by``): a request
in flight that holds no sequence yet — one waiting to replay on a new pipeline after a loss
— keeps the pipeline busy, so a regrow neither refuses new requests nor replays it twice."""

from __future__ import annotations

from typing import Any, cast

import trio

from meshnode.node.remote import RemotePipeline, idle_by


class _Runner:
    live_sequences = 0


class _Pipeline:
    """No sequence on it (the replaying request has not been admitted yet)."""

    runner = _Runner()

    async def wait_idle(self) -> None:
        return


def _pipeline() -> RemotePipeline:
    return cast(RemotePipeline, _Pipeline())


async def test_a_request_without_a_sequence_keeps_the_pipeline_busy(autojump_clock: Any) -> None:
    in_flight = [1]
    ended: list[tuple[bool | None, float]] = []

    async def watch() -> None:
        idle = await idle_by(_pipeline(), 30.0, trio.sleep_forever, in_flight=lambda: in_flight[0])
        ended.append((idle, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.sleep(5.0)
        assert ended == []  # still in flight: not idle
        in_flight[0] = 0
    ((idle, at),) = ended
    assert idle is True
    assert 5.0 <= at <= 5.0 + 2 * 0.1  # seen within a poll or two


async def test_a_request_that_stays_in_flight_is_not_idle_by_the_deadline(
    autojump_clock: Any,
) -> None:
    idle = await idle_by(_pipeline(), 30.0, trio.sleep_forever, in_flight=lambda: 1)
    assert idle is False
    assert trio.current_time() >= 30.0


async def test_nothing_in_flight_is_idle_at_once(autojump_clock: Any) -> None:
    assert await idle_by(_pipeline(), 30.0, trio.sleep_forever, in_flight=lambda: 0) is True
    assert trio.current_time() == 0.0


async def test_a_membership_change_interrupts_the_wait(autojump_clock: Any) -> None:
    async def change() -> None:
        await trio.sleep(3.0)

    assert await idle_by(_pipeline(), 30.0, change, in_flight=lambda: 1) is None
