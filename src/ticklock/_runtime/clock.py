"""The clock protocol and the system clock (tests inject :class:`ticklock.testing.ManualClock`)."""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from typing import Protocol, runtime_checkable

import anyio


@runtime_checkable
class Clock(Protocol):
    """What the scheduler needs of time."""

    def now(self) -> datetime:
        """The current wall time, aware, in UTC."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards and never steps."""

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``monotonic()`` has reached ``deadline`` (``math.inf``: never)."""


class SystemClock:
    """The real clock: wall time from the OS, deadlines on the event loop's monotonic clock."""

    __slots__ = ("__weakref__",)  # the database's time is carried per clock object

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


async def until(event: anyio.Event, clock: Clock, deadline: float) -> None:
    """Wait until ``event`` is set or the ``clock`` reaches ``deadline`` (monotonic)."""
    async with anyio.create_task_group() as tg:

        async def sleep() -> None:
            await clock.sleep_until(deadline)
            tg.cancel_scope.cancel()

        tg.start_soon(sleep)
        await event.wait()
        tg.cancel_scope.cancel()
