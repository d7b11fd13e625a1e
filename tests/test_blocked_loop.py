"""A handler that blocks the event loop is named in a WARNING, whatever the other jobs do.

These tests block for real (``time.sleep``) on the system clock: blocking is about real time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import anyio
import anyio.lowlevel
import pytest

from ticklock import JobContext, Scheduler, SystemClock, every
from ticklock._runtime.loop import Dispatcher
from ticklock._runtime.runner import watch as watch_with


async def watch(awaitable: Awaitable[T], job_id: str) -> T:
    """watch(), reporting through a dispatcher's WARNING as a scheduler's runs do."""
    dispatcher = Dispatcher(SystemClock())
    return await watch_with(awaitable, job_id, dispatcher.blocked)


pytestmark = pytest.mark.anyio
T = TypeVar("T")


def blocked_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "event loop was blocked" in r.getMessage()
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_step_that_blocks_the_loop_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler() -> int:
        await anyio.lowlevel.checkpoint()  # the blocking step is not the first one
        time.sleep(1.2)  # noqa: ASYNC251 - the mistake this test is about
        await anyio.lowlevel.checkpoint()
        return 7

    assert await watch(handler(), "nightly-report") == 7
    [warning] = blocked_warnings(caplog)
    assert warning.getMessage().startswith(
        "the event loop was blocked for 1.2 s by job 'nightly-report': its handler runs "
        "synchronous work on the event loop"
    )
    assert "anyio.to_thread.run_sync" in warning.getMessage()
    assert warning.job_id == "nightly-report"  # type: ignore[attr-defined]


async def test_watch_passes_results_exceptions_and_cancellation_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def steps(n: int) -> int:
        for _ in range(n):
            await anyio.lowlevel.checkpoint()
        return n

    assert await watch(steps(0), "a") == 0
    assert await watch(steps(3), "a") == 3

    class Boom(Exception):
        pass

    boom = Boom()

    async def fails() -> None:
        await anyio.lowlevel.checkpoint()
        raise boom

    with pytest.raises(Boom) as raised:
        await watch(fails(), "a")
    assert raised.value is boom

    # cancellation reaches the handler, which may clean up (and await) before it ends
    cleaned = False

    async def hangs() -> None:
        nonlocal cleaned
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()
            cleaned = True

    with anyio.move_on_after(0.01) as scope:
        await watch(hangs(), "a")
    assert scope.cancelled_caught and cleaned

    # an exception thrown in and caught by the handler lets it go on
    async def survives() -> str:
        with anyio.move_on_after(0.01):
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()
        return "went on"

    assert await watch(survives(), "a") == "went on"
    assert blocked_warnings(caplog) == []  # no step came near the limit


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_scheduled_handler_that_blocks_the_loop_is_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = Scheduler()  # the real clock
    beats = 0

    @scheduler.job(every(0.1), id="beat")
    async def beat(ctx: JobContext) -> None:
        nonlocal beats
        beats += 1

    @scheduler.job(every(60, initial_delay=0.2), id="blocker")
    async def blocker(ctx: JobContext) -> None:
        time.sleep(1.2)  # noqa: ASYNC251 - the mistake this test is about

    async with scheduler:
        await anyio.sleep(1.6)
    # one warning, naming the job: the dispatcher's own (late by the same block) is not added
    [warning] = blocked_warnings(caplog)
    assert "by job 'blocker'" in warning.getMessage()
    assert beats > 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_ledger_names_the_job_that_blocked_the_loop_in_memory_too() -> None:
    from datetime import datetime, timezone

    from ticklock._operators.fleet import Fate
    from ticklock.testing import MemoryDatabase

    db = MemoryDatabase()
    scheduler = Scheduler(database=db, owner="m")
    blocked = anyio.Event()

    @scheduler.job(every(60), id="blocker")
    async def blocker(ctx: JobContext) -> None:
        time.sleep(1.2)  # noqa: ASYNC251 - the mistake this test is about
        blocked.set()

    @scheduler.job(every(0.2), id="victim", timeout=0.1)
    async def victim(ctx: JobContext) -> None: ...

    start = datetime.now(timezone.utc)
    async with scheduler:
        await blocked.wait()
        await anyio.sleep(0.5)
    [stall] = db.incidents
    assert (stall.owner, stall.kind, stall.detail) == ("m", "stalled", "blocker")
    assert round((stall.until - stall.since).total_seconds(), 1) == 1.2
    ledger = await scheduler.fleet.slots("victim", start, datetime.now(timezone.utc))
    cost = [s for s in ledger if s.fate in (Fate.COVERED, Fate.MISSED) and s.slot < stall.until]
    assert cost, ledger
    assert {s.reason for s in cost} == {
        "replica m's event loop was blocked by job 'blocker' for 1.2 s"
    }, ledger
