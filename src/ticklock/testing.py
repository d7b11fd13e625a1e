"""Test helpers that are part of ticklock's public API.

:class:`ManualClock` replaces the system clock so that tests of schedules advance virtual
time instead of sleeping::

    clock = ManualClock(datetime(2026, 3, 29, 0, 0, tzinfo=timezone.utc))
    scheduler = Scheduler(clock=clock)
    ...
    async with scheduler:
        await clock.advance(3600)      # every deadline on the way fires, in order
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from datetime import datetime, timedelta, timezone

import anyio

__all__ = ("ManualClock",)

_DEFAULT_START = datetime(2030, 1, 1, tzinfo=timezone.utc)
_SETTLE_ROUNDS = 10_000  # bounds the wait when some task never blocks


class ManualClock:
    """A clock that moves only when told to; time never goes backwards.

    ``now()`` and ``monotonic()`` advance together. ``await advance(seconds)`` walks through
    every sleeper's deadline in order, letting all tasks run at each one, so the code under
    test sees exactly the instants it asked for.
    """

    def __init__(self, start: datetime | None = None) -> None:
        if start is None:
            start = _DEFAULT_START
        if start.tzinfo is None or start.utcoffset() is None:
            raise ValueError(f"ManualClock(start): start must be an aware datetime, got {start!r}")
        self._start = start.astimezone(timezone.utc)
        self._elapsed = 0.0
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._counter = itertools.count()

    def now(self) -> datetime:
        """The virtual wall time, aware, in UTC."""
        return self._start + timedelta(seconds=self._elapsed)

    def monotonic(self) -> float:
        """Virtual seconds since the clock was made."""
        return self._elapsed

    async def sleep_until(self, deadline: float) -> None:
        """Wait until virtual time reaches ``deadline`` (``math.inf``: forever)."""
        if deadline <= self._elapsed:
            await anyio.lowlevel.checkpoint()
            return
        if math.isinf(deadline):
            await anyio.sleep_forever()
        event = anyio.Event()
        heapq.heappush(self._sleepers, (deadline, next(self._counter), event))
        await event.wait()

    async def advance(self, seconds: float | timedelta) -> None:
        """Move virtual time forward by ``seconds`` (a number or a timedelta), waking every
        sleeper on the way in order."""
        step = seconds.total_seconds() if isinstance(seconds, timedelta) else seconds
        if not 0 <= step < math.inf:
            raise ValueError(
                f"ManualClock.advance: seconds must be non-negative and finite, got {seconds!r}"
            )
        target = self._elapsed + step
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline = self._sleepers[0][0]
            self._elapsed = max(self._elapsed, deadline)
            while self._sleepers and self._sleepers[0][0] <= self._elapsed:
                heapq.heappop(self._sleepers)[2].set()
            await _settle()
        self._elapsed = max(self._elapsed, target)
        await _settle()

    async def settle(self) -> None:
        """Let every task run until all are blocked, without moving time."""
        await _settle()


async def _settle() -> None:
    """Return once every other task is blocked (anyio's asyncio version naps 0.1 s per try)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio's own wait_all_tasks_blocked is exact
        await anyio.wait_all_tasks_blocked()
        return
    this = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for _ in range(_SETTLE_ROUNDS):
        await asyncio.sleep(0)
        # pending callbacks (e.g. anyio delivering a cancellation) are work still to do
        if getattr(loop, "_ready", None):
            continue
        for task in asyncio.all_tasks():
            if task is this:
                continue
            waiter = getattr(task, "_fut_waiter", None)
            if waiter is None or waiter.done():
                break
        else:
            return
