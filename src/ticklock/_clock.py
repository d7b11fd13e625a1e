"""The clock protocol and the system clock.

A clock has three methods: ``now()`` (aware UTC wall time), ``monotonic()`` (seconds on a
clock that never steps) and ``await sleep_until(deadline)`` (a ``monotonic()`` deadline).
The scheduler asks its clock, never ``datetime.now()`` inline, so tests inject
:class:`ticklock.testing.ManualClock` and run schedules without real sleeps.
"""

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
