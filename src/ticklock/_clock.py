"""The clock protocol and the system clock.

A clock has three methods: ``now()`` (aware UTC wall time), ``monotonic()`` (seconds on a
clock that never steps) and ``await sleep_until(deadline)`` (a ``monotonic()`` deadline).
The scheduler asks its clock, never ``datetime.now()`` inline, so tests inject
:class:`ticklock.testing.ManualClock` and run schedules without real sleeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
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


def native_deadline_scope(deadline: float) -> anyio.CancelScope:
    """A cancel scope for a ``SystemClock.monotonic()`` deadline, on the event loop's clock."""
    return anyio.CancelScope(deadline=anyio.current_time() + (deadline - time.monotonic()))


@asynccontextmanager
async def deadline_scope(clock: Clock, deadline: float) -> AsyncIterator[anyio.CancelScope]:
    """A cancel scope that is cancelled when ``clock`` reaches ``deadline``.

    On the system clock this is a plain ``CancelScope(deadline=...)``; on any other clock a
    watcher task sleeps on that clock, so virtual time drives timeouts too.
    """
    if type(clock) is SystemClock:
        with native_deadline_scope(deadline) as scope:
            yield scope
        return
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
