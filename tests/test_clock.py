"""The clocks: ManualClock never goes backwards; the system clock survives wall-clock steps."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import anyio
import anyio.lowlevel
import pytest
import time_machine

from helpers import SteppingClock
from ticklock import JobContext, Scheduler, cron, every
from ticklock.testing import ManualClock

pytestmark = [pytest.mark.anyio, pytest.mark.asyncio_only]


async def test_manual_clock_moves_only_forward_and_wakes_sleepers_in_order() -> None:
    clock = ManualClock(datetime(2026, 1, 1, tzinfo=timezone.utc))
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, deadline: float) -> None:
        await clock.sleep_until(deadline)
        woke.append((name, clock.monotonic()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper, "b", 7.5)
        tg.start_soon(sleeper, "a", 2)
        await clock.advance(10)
    assert woke == [("a", 2), ("b", 7.5)]
    assert clock.now() == datetime(2026, 1, 1, 0, 0, 10, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="seconds must be non-negative"):
        await clock.advance(-1)
    with pytest.raises(ValueError, match="start must be an aware datetime"):
        ManualClock(datetime(2026, 1, 1))


async def test_manual_clock_advances_by_a_timedelta_and_refuses_non_finite_steps() -> None:
    clock = ManualClock(datetime(2026, 1, 1, tzinfo=timezone.utc))
    await clock.advance(timedelta(seconds=2.5))
    assert clock.monotonic() == 2.5
    assert clock.now() == datetime(2026, 1, 1, 0, 0, 2, 500000, tzinfo=timezone.utc)
    for bad in (float("nan"), float("inf"), timedelta(seconds=-1)):
        message = r"^ManualClock\.advance: seconds must be non-negative and finite, got "
        with pytest.raises(ValueError, match=message + re.escape(repr(bad)) + "$"):
            await clock.advance(bad)
    assert clock.monotonic() == 2.5


async def _first_fire(step: float, start: datetime) -> tuple[datetime, datetime, float]:
    """Run a minutely cron job on the system clock; step the wall clock by ``step`` at once."""
    fired = anyio.Event()
    seen: dict[str, object] = {}
    scheduler = Scheduler()

    @scheduler.job(cron("* * * * *"), id="minutely")
    async def minutely(ctx: JobContext) -> None:
        seen["slot"], seen["wall"] = ctx.slot, datetime.now(timezone.utc)
        fired.set()

    with time_machine.travel(start, tick=True) as traveller:
        async with scheduler:
            await anyio.sleep(0.2)
            t0 = anyio.current_time()
            traveller.shift(timedelta(seconds=step))
            with anyio.fail_after(15):
                await fired.wait()
            waited = anyio.current_time() - t0
    return seen["slot"], seen["wall"], waited  # type: ignore[return-value]


async def test_a_backward_wall_step_never_fires_a_cron_job_early() -> None:
    start = datetime(2026, 1, 1, 12, 0, 57, tzinfo=timezone.utc)
    slot, wall, waited = await _first_fire(-2.0, start)
    assert slot == datetime(2026, 1, 1, 12, 1, tzinfo=timezone.utc)
    assert wall >= slot  # the monotonic deadline came 2 s before the wall instant: it waited
    assert waited >= 4.0


async def test_a_forward_wall_step_is_noticed_within_five_seconds() -> None:
    start = datetime(2026, 1, 1, 12, 0, 2, tzinfo=timezone.utc)
    slot, wall, waited = await _first_fire(60.0, start)  # 12:01:02: the 12:01 fire is due
    assert slot == datetime(2026, 1, 1, 12, 1, tzinfo=timezone.utc)
    assert waited <= 5.5  # not the 58 s the monotonic deadline said


async def test_a_wall_step_after_the_first_cron_job_is_added_while_running_is_noticed() -> None:
    # The loop sleeps toward an every() job's deadline when the first cron job is added; the
    # wall clock then steps forward 59 minutes: the hourly fire it passed comes within 5 s.
    clock = SteppingClock(datetime(2026, 1, 1, 12, 0, 30, tzinfo=timezone.utc))
    scheduler = Scheduler(clock=clock, owner="a")
    fired: list[tuple[datetime, float]] = []

    @scheduler.job(every(10, initial_delay=10), id="tick", timeout=5)
    async def tick(ctx: JobContext) -> None:
        pass

    async with scheduler:
        await clock.advance(1)

        @scheduler.job(cron("0 * * * *"), id="hourly", timeout=5)
        async def hourly(ctx: JobContext) -> None:
            fired.append((ctx.slot, clock.monotonic()))

        await clock.advance(1)
        clock.offset = 59 * 60.0  # 12:00:32 -> 12:59:32: 13:00 passes 28 s later
        stepped = clock.monotonic()
        for _ in range(40):
            await clock.advance(1)
    [(slot, at)] = fired
    assert slot == datetime(2026, 1, 1, 13, tzinfo=timezone.utc)
    assert at - stepped <= 28 + 5  # noticed within the 5 s bound, not an hour late
