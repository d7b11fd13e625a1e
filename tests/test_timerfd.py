"""The dispatcher's precise sleep (a timerfd on Linux + asyncio): never early, re-armable,
cancellable, closed with the scheduler; absent where it cannot work."""

from __future__ import annotations

import os
import sys
import time

import anyio
import pytest

from ticklock import JobContext, Scheduler, every
from ticklock._timerfd import Timer, _LibcTimerFd, _OsTimerFd, open_timer

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux-only"),
]
FD_KINDS = [
    _LibcTimerFd,
    pytest.param(
        _OsTimerFd,
        marks=pytest.mark.skipif(not hasattr(os, "timerfd_create"), reason="Python < 3.13"),
    ),
]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", FD_KINDS)
async def test_the_timer_never_wakes_before_its_deadline_and_can_be_rearmed(
    kind: type[_LibcTimerFd],
) -> None:
    import asyncio

    timer = Timer(asyncio.get_running_loop(), kind())
    try:
        for delay in (0.0, 0.003, 0.0105, 0.02):
            deadline = time.monotonic() + delay
            with anyio.fail_after(5):
                await timer.sleep_until(deadline)
            assert time.monotonic() >= deadline
        # cancelled while armed far ahead, then re-armed for a near deadline: the old
        # deadline is gone (a long wait would fail the 5 s bound)
        with anyio.move_on_after(0.01):
            await timer.sleep_until(time.monotonic() + 3600)
        deadline = time.monotonic() + 0.01
        with anyio.fail_after(5):
            await timer.sleep_until(deadline)
        assert time.monotonic() >= deadline
        # a past deadline returns at once; inf waits until cancelled
        with anyio.fail_after(5):
            await timer.sleep_until(time.monotonic() - 1)
        with anyio.move_on_after(0.02) as scope:
            await timer.sleep_until(float("inf"))
        assert scope.cancelled_caught
    finally:
        timer.close()


async def test_open_timer_is_asyncio_only(anyio_backend: str) -> None:
    timer = open_timer()
    if anyio_backend == "trio":
        assert timer is None
    else:
        assert isinstance(timer, Timer)
        timer.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_scheduler_closes_its_timer_when_it_stops() -> None:
    runs: list[float] = []
    three = anyio.Event()
    scheduler = Scheduler()

    @scheduler.job(every(0.01), id="fast", timeout=0.005)
    async def fast(ctx: JobContext) -> None:
        runs.append(ctx.slot.timestamp())
        if len(runs) == 3:
            three.set()

    before = open_fds()
    async with scheduler:
        with anyio.fail_after(5):
            await three.wait()
    assert open_fds() == before
