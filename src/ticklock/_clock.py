"""The clock protocol and the system clock.

A clock has three methods: ``now()`` (aware UTC wall time), ``monotonic()`` (seconds on a
clock that never steps) and ``await sleep_until(deadline)`` (a ``monotonic()`` deadline).
The scheduler asks its clock, never ``datetime.now()`` inline, so tests inject
:class:`ticklock.testing.ManualClock` and run schedules without real sleeps.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager
from datetime import datetime, timezone
from types import TracebackType
from typing import Protocol, runtime_checkable

import anyio


@runtime_checkable
class Clock(Protocol):
    """What the scheduler needs of time."""

    def now(self) -> datetime:
        """The current wall time, aware, in UTC."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards and never steps."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``monotonic()`` has reached ``deadline`` (``math.inf``: never)."""
        ...


class SystemClock:
    """The real clock: wall time from the OS, deadlines on the event loop's monotonic clock."""

    __slots__ = ()

    def now(self) -> datetime:
        """The current wall time, aware, in UTC."""
        return datetime.now(timezone.utc)

    def monotonic(self) -> float:
        """``time.monotonic()``: it never steps (a VM suspend pauses it)."""
        return time.monotonic()

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until ``time.monotonic()`` reaches ``deadline``."""
        if math.isinf(deadline):
            await anyio.sleep_forever()
        await anyio.sleep(max(0.0, deadline - time.monotonic()))


class SystemDeadlines:
    """Makes the cancel scopes that bound runs on the system clock (create it in the loop).

    On asyncio, every scope is an anyio cancel scope *without* a deadline (so shields inside
    a handler still hold), and one loop timer, armed for the earliest deadline of all scopes
    in flight, cancels each scope whose deadline has passed. A scope that exits is marked
    done; its heap entry is dropped at once if it is the earliest, else when it becomes so.
    The heap thus holds the scopes in flight plus those that finished after one still running
    with an earlier deadline, and the timer stays armed (it may fire for nothing, then
    re-arms). This costs a heap push and pop per run, where ``CancelScope(deadline=...)`` or a
    loop timer per scope cost 3-5 µs (measured A/B on P4). Elsewhere (trio) the scope's own
    deadline is cheap.
    """

    __slots__ = ("_armed", "_handle", "_heap", "_loop", "_scope_class", "_sequence")

    def __init__(self) -> None:
        # The backend's own class: calling it skips anyio's per-call backend lookup.
        self._scope_class = type(anyio.CancelScope())
        self._loop: asyncio.AbstractEventLoop | None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._heap: list[tuple[float, int, _Bounded]] = []
        self._sequence = itertools.count().__next__
        self._armed = math.inf  # the deadline the loop timer is armed for
        self._handle: asyncio.TimerHandle | None = None

    def scope(self, deadline: float) -> AbstractContextManager[anyio.CancelScope]:
        """A cancel scope that is cancelled when ``time.monotonic()`` reaches ``deadline``."""
        if self._loop is None:
            return anyio.CancelScope(deadline=anyio.current_time() + deadline - time.monotonic())
        return _Bounded(self, deadline)

    def _add(self, bounded: _Bounded) -> None:
        deadline = bounded.deadline
        heapq.heappush(self._heap, (deadline, self._sequence(), bounded))
        if deadline < self._armed:
            self._arm(deadline)

    def _remove(self, bounded: _Bounded) -> None:
        # done: its entry goes now if it is the earliest, with the finished ones under it,
        # else once it becomes the earliest
        heap = self._heap
        if heap and heap[0][2] is bounded:
            heapq.heappop(heap)
            while heap and heap[0][2].active is None:
                heapq.heappop(heap)

    def _arm(self, deadline: float) -> None:
        assert self._loop is not None
        if self._handle is not None:
            self._handle.cancel()
        self._armed = deadline
        self._handle = self._loop.call_later(deadline - time.monotonic(), self._expire)

    def _expire(self) -> None:
        self._handle = None
        self._armed = math.inf
        heap = self._heap
        now = time.monotonic()
        while heap and ((scope := heap[0][2].active) is None or heap[0][0] <= now):
            heapq.heappop(heap)
            if scope is not None:
                scope.cancel()
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        """Disarm the loop timer (once no scope is in flight: at shutdown)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed = math.inf
        self._heap.clear()


class _Bounded:
    """One scope of :class:`SystemDeadlines`: ``active`` is its cancel scope while entered."""

    __slots__ = ("_owner", "active", "deadline")

    def __init__(self, owner: SystemDeadlines, deadline: float) -> None:
        self._owner = owner
        self.deadline = deadline
        self.active: anyio.CancelScope | None = None

    def __enter__(self) -> anyio.CancelScope:
        scope = self.active = self._owner._scope_class().__enter__()
        self._owner._add(self)
        return scope

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        scope = self.active
        assert scope is not None
        self.active = None
        self._owner._remove(self)
        return scope.__exit__(exc_type, exc, tb)


@asynccontextmanager
async def deadline_scope(clock: Clock, deadline: float) -> AsyncIterator[anyio.CancelScope]:
    """A cancel scope that is cancelled when ``clock`` reaches ``deadline``.

    A watcher task sleeps on ``clock``, so virtual time drives timeouts too (the system
    clock has :class:`SystemDeadlines`).
    """
    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as scope:

            async def watch() -> None:
                await clock.sleep_until(deadline)
                scope.cancel()

            tg.start_soon(watch)
            try:
                yield scope
            finally:
                tg.cancel_scope.cancel()
