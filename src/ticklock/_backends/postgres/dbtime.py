"""The database's time as a replica carries it: the reference for "in the database's future".

A slot, an end or a failure's end is refused when it lies more than
:data:`~ticklock._backends.seam.FUTURE_LIMIT` seconds beyond ``greatest(clock_timestamp(),
anchor)``: the database's own clock, or the anchor, whichever is later. The anchor is the
database's clock as read when a coordinator connected, carried forward on the replica's
monotonic clock (the instant read + the monotonic seconds since the read).

- A replica whose wall clock is wrong still has a monotonic clock that runs at the real rate,
  so its anchor stays at the database's time: a wall clock ahead is refused.
- A :class:`~ticklock.testing.ManualClock` moves its monotonic clock with ``advance()``, so the
  anchor moves with it and the database accepts the slots of a test that advances by days.
- A monotonic clock that stood still while the wall clock went on (a VM suspended, on some
  hosts) leaves the anchor behind; ``greatest()`` with ``clock_timestamp()`` covers that.

The anchor belongs to the clock object: every scheduler that shares one clock shares it, so
that one started after ``advance()`` knows the time the others carried. A new read of the
database's clock (at each connect) replaces the anchor only when it is later. The anchor's
error is the monotonic clock's drift since the read it came from, far below the limit on a
host whose clock NTP disciplines. One clock used with two databases carries one anchor: their
clocks are taken to agree as closely as the replicas' do.
"""

from __future__ import annotations

import weakref
from datetime import datetime, timedelta

from ..._runtime.clock import Clock


class DatabaseTime:
    """The database's clock as last read, and the monotonic instant of that read."""

    __slots__ = ("_monotonic", "_server")

    def __init__(self) -> None:
        self._server: datetime | None = None
        self._monotonic = 0.0

    def observe(self, server: datetime, monotonic: float) -> None:
        """Note a read of the database's clock (``server``) made at ``monotonic``: it becomes
        the anchor if it is later than the one carried so far."""
        carried = self.at(monotonic)
        if carried is None or server > carried:
            self._server, self._monotonic = server, monotonic

    def at(self, monotonic: float) -> datetime | None:
        """The anchor at ``monotonic`` (``None`` before the first read)."""
        if self._server is None:
            return None
        return self._server + timedelta(seconds=monotonic - self._monotonic)


_TIMES: weakref.WeakKeyDictionary[Clock, DatabaseTime] = weakref.WeakKeyDictionary()


def database_time(clock: Clock) -> DatabaseTime:
    """The :class:`DatabaseTime` carried on ``clock``, shared by every coordinator that uses
    it; a clock that cannot be weakly referenced (or hashed) gets one of its own."""
    try:
        found = _TIMES.get(clock)
        if found is None:
            found = _TIMES[clock] = DatabaseTime()
    except TypeError:
        return DatabaseTime()
    return found
