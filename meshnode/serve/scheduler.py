"""Admission of requests: how many generate at once, and how many may wait.

Every admitted request gets its own sequence (and so its own KV cache on every stage);
the pipeline batches the ready passes of all of them into one forward per step
(:mod:`meshnode.node.batcher`). Requests beyond ``max_in_flight``
wait in FIFO order; beyond ``max_waiting`` they are refused with a 503 so that a burst
turns into quick retries instead of an unbounded queue of stalled connections.

A request takes a :class:`Ticket` as soon as it arrives (:meth:`Scheduler.enter`, which
refuses at once when the queue is full) and holds it from the queue through its slot until
it ends. Its prompt is rendered and tokenized only once the ticket holds a slot, so a
flood of large prompts waits (or is refused) before it costs any work.

**KV blocks** (issue 30). A CPU or CUDA stage keeps one pool of KV blocks for all its sequences,
a few whole contexts (:func:`meshnode.node.prefix.pool_blocks`), not one per sequence. So a
ticket that holds a slot then takes the blocks its request may write
(:meth:`Ticket.take_blocks`: prompt, ``max_tokens`` and a verify pass's drafts), waiting in
FIFO order until the pipeline's budget has room: a stage never runs out mid-flight, and a
long request at the head of the line is never overtaken forever by short ones.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from meshnode.node.pipeline import MAX_SEQUENCES_PER_STAGE, RequestId
from meshnode.serve.errors import ServiceUnavailableError

#: Sequences generating at once. Each holds a KV cache on every stage, so this bounds
#: memory; stages allow exactly this many live sequences.
DEFAULT_MAX_IN_FLIGHT = MAX_SEQUENCES_PER_STAGE
#: Requests waiting for a slot before new ones get 503. Eight slots turn over within
#: seconds on a small model; a deeper queue would only hold clients past their timeouts.
DEFAULT_MAX_WAITING = 64


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """Admission limits (counts of requests)."""

    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_waiting: int = DEFAULT_MAX_WAITING

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_waiting < 0:
            raise ValueError(f"invalid scheduler limits: {self}")


class Scheduler:
    """Admits requests into at most ``max_in_flight`` concurrent generations."""

    def __init__(self, limits: SchedulerLimits | None = None):
        self.limits = limits or SchedulerLimits()
        self._slots = trio.Semaphore(self.limits.max_in_flight)
        self._waiting = 0
        self._blocks = 0  # KV blocks the tickets hold (Ticket.take_blocks)
        self._block_waiters = 0  # tickets with a slot waiting for blocks
        self._block_line = trio.Lock()  # FIFO: the head of the line waits for room
        self._blocks_freed = trio.Event()
        self._ids = itertools.count()
        # A per-process prefix keeps request ids unique across restarts of the host, so a
        # stage never mistakes a new request for an old sequence it still holds.
        self._prefix = secrets.token_hex(4)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        return self.limits.max_in_flight - self._slots.value

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return self._waiting

    @property
    def blocks(self) -> int:
        """KV blocks the admitted requests hold (:meth:`Ticket.take_blocks`)."""
        return self._blocks

    @property
    def waiting_for_blocks(self) -> int:
        """Requests holding a slot that wait for KV blocks (:meth:`Ticket.take_blocks`)."""
        return self._block_waiters

    def check_capacity(self) -> None:
        """Raise ServiceUnavailableError (503) if a new request could not even queue."""
        if self._slots.value == 0 and self._waiting >= self.limits.max_waiting:
            raise ServiceUnavailableError(
                "Too many requests are waiting; retry shortly.", retry_after_s=1
            )

    def enter(self) -> Ticket:
        """A place in the queue for a new request (waiting; :meth:`Ticket.acquire` waits
        for its slot). Raises ServiceUnavailableError (503) if the queue is full."""
        self.check_capacity()
        self._waiting += 1
        return Ticket(self)

    def new_request_id(self) -> RequestId:
        """A request id unique within this process and, with high probability, across."""
        return RequestId(f"req-{self._prefix}-{next(self._ids)}")

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one generation slot for the body of the ``async with``.

        Raises ServiceUnavailableError if the waiting queue is full.
        """
        ticket = self.enter()
        try:
            await ticket.acquire()
            yield
        finally:
            ticket.release()


class Ticket:
    """One request's place: waiting for a slot, then holding it, until :meth:`release`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._state = "waiting"  # -> "holding" -> "released"; or "waiting" -> "released"
        self._blocks = 0  # KV blocks held (take_blocks)

    @property
    def holding(self) -> bool:
        """Whether the ticket holds a generation slot."""
        return self._state == "holding"

    async def acquire(self) -> None:
        """Wait (FIFO) for a generation slot."""
        if self._state != "waiting":
            raise RuntimeError(f"a {self._state} ticket cannot acquire a slot")
        await self._scheduler._slots.acquire()
        self._scheduler._waiting -= 1
        self._state = "holding"

    async def take_blocks(self, blocks: int, budget: int) -> None:
        """Wait (FIFO) until the requests admitted hold at most ``budget - blocks`` KV
        blocks, then hold ``blocks`` until :meth:`release`. Raises ``ValueError`` for more
        than ``budget`` (the caller refuses such a request first) or a ticket without a slot
        or with blocks already."""
        s = self._scheduler
        if self._state != "holding" or self._blocks or not 0 < blocks <= budget:
            raise ValueError(f"a {self._state} ticket cannot take {blocks} of {budget} blocks")
        s._block_waiters += 1
        try:
            async with s._block_line:
                while s._blocks + blocks > budget:
                    s._blocks_freed = trio.Event()
                    await s._blocks_freed.wait()
                s._blocks += blocks
                self._blocks = blocks
        finally:
            s._block_waiters -= 1

    def release(self) -> None:
        """Give the slot and the blocks (or the place in the queue) back; idempotent."""
        if self._blocks:
            self._scheduler._blocks -= self._blocks
            self._blocks = 0
            self._scheduler._blocks_freed.set()
        if self._state == "holding":
            self._scheduler._slots.release()
        elif self._state == "waiting":
            self._scheduler._waiting -= 1
        self._state = "released"
