"""A precise sleep for the dispatcher on Linux and asyncio: a timerfd armed for the deadline.

asyncio wakes its timers through ``epoll_wait``, whose timeout is whole milliseconds rounded
up, so every sleeper wakes 0-1 ms late (the floor of P1 in ``docs/benchmarks.md``). A timerfd
on ``CLOCK_MONOTONIC`` (the clock of ``time.monotonic()``) expires with nanosecond
resolution, and epoll reports it readable at once. The dispatcher is the only sleeper that
needs this, so there is one timerfd per running scheduler, closed when it stops.

Python 3.13 has ``os.timerfd_create``; older versions call libc through ctypes. Elsewhere
(not Linux, not asyncio, a 32-bit ``time_t``) :func:`open_timer` returns ``None`` and the
clock's own sleep is used.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import sys
import time
from typing import Any, Protocol

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Fd(Protocol):
    fd: int

    def arm_ns(self, deadline_ns: int) -> None: ...


class _OsTimerFd:
    """``os.timerfd_*`` (Python 3.13+)."""

    def __init__(self) -> None:
        flags = os.TFD_NONBLOCK | os.TFD_CLOEXEC  # type: ignore[attr-defined,unused-ignore]
        self.fd: int = os.timerfd_create(time.CLOCK_MONOTONIC, flags=flags)  # type: ignore[attr-defined,unused-ignore]

    def arm_ns(self, deadline_ns: int) -> None:
        os.timerfd_settime_ns(self.fd, flags=os.TFD_TIMER_ABSTIME, initial=deadline_ns)  # type: ignore[attr-defined,unused-ignore]


class _LibcTimerFd:
    """``timerfd_create``/``timerfd_settime`` from libc, through ctypes."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.POINTER(_Itimerspec),
        ]
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        self.fd = int(fd)
        self._spec = _Itimerspec()

    def arm_ns(self, deadline_ns: int) -> None:
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(deadline_ns, 1_000_000_000)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))


class Timer:
    """Sleeps until a ``time.monotonic()`` deadline, waking within microseconds of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: _Fd) -> None:
        self._loop = loop
        self._fd = fd
        self._waiter: asyncio.Future[None] | None = None
        loop.add_reader(fd.fd, self._expired)

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``time.monotonic()`` has reached ``deadline`` (``inf``: never)."""
        waiter = self._waiter = self._loop.create_future()
        # Arming replaces the previous deadline and clears an expiry not yet read; inf leaves
        # the timer disarmed (0).
        self._fd.arm_ns(0 if math.isinf(deadline) else max(1, math.ceil(deadline * 1e9)))
        try:
            await waiter
        finally:
            self._waiter = None

    def _expired(self) -> None:
        try:
            os.read(self._fd.fd, 8)
        except BlockingIOError:  # an expiry that a re-arm cleared
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Stop watching the timerfd and close it."""
        self._loop.remove_reader(self._fd.fd)
        os.close(self._fd.fd)


def open_timer() -> Timer | None:
    """A :class:`Timer` on the running asyncio loop, or ``None`` where there is none."""
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_long) != 8:
        return None
    try:
        loop: Any = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        return None
    try:
        fd: _Fd = _OsTimerFd() if hasattr(os, "timerfd_create") else _LibcTimerFd()
    except (OSError, AttributeError):
        return None
    try:
        return Timer(loop, fd)
    except (NotImplementedError, RuntimeError):  # a loop without add_reader
        os.close(fd.fd)
        return None
