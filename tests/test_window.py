"""A job's window: ``start`` and ``end`` (both inclusive), on a ManualClock. No slot before
``start`` (an ``every`` job's first slot is ``start`` plus its initial delay) nor after
``end``; after ``end`` the job is ``ended``: never overdue, and ``ticklock status`` passes it;
the ledger lists the fires outside the window as skipped, saying which side."""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import pytest

from helpers import at
from ticklock import JobContext, ScheduleError, Scheduler, cron, every
from ticklock._backends.seam import FleetState
from ticklock._operators.fleet import Fate, JobState
from ticklock._runtime.plan import Skip, admit
from ticklock._schedule.job import Job
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


def since_t0(when: datetime) -> float:
    return (when - T0).total_seconds()


async def test_an_every_jobs_first_slot_is_its_start_plus_the_initial_delay() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    slots: list[float] = []

    @scheduler.job(every(600, initial_delay=30), id="w", start=T0 + timedelta(hours=1))
    async def w(ctx: JobContext) -> None:
        slots.append(since_t0(ctx.slot))

    async with scheduler:
        [health] = scheduler.health()
        assert health.next_fire == T0 + timedelta(hours=1, seconds=30)
        await clock.advance(3600 + 30 + 1200)
    assert slots == [3630, 4230, 4830]


async def test_a_cron_job_runs_only_within_its_window_then_has_ended() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(clock=clock, database=db)
    slots: list[float] = []
    paris = ZoneInfo("Europe/Paris")  # start and end in any zone: the same instants

    @scheduler.job(
        cron("*/10 * * * *"),
        id="c",
        timeout=5,
        start=datetime(2026, 3, 29, 3, 20, tzinfo=paris),  # 01:20 UTC (summer time began)
        end=T0 + timedelta(hours=1, minutes=50),  # inclusive
    )
    async def c(ctx: JobContext) -> None:
        slots.append(since_t0(ctx.slot) / 60)

    async with scheduler:
        await clock.advance(3 * 3600)
        [health] = scheduler.health()
        assert health.ended and not health.overdue and health.next_fire is None
        assert "c" not in scheduler._roster.cycles  # nothing to wait for: a row
        [record] = await scheduler.fleet.jobs()
        assert record.state is JobState.ENDED
        ledger = await scheduler.fleet.slots(
            "c", T0 + timedelta(hours=1), T0 + timedelta(hours=2, minutes=10)
        )
    assert slots == [80, 90, 100, 110]
    fates = [(since_t0(s.slot) / 60, s.fate, s.reason) for s in ledger]
    assert fates[:2] == [(60, Fate.SKIPPED, "before start"), (70, Fate.SKIPPED, "before start")]
    assert [f for _, f, _ in fates[2:6]] == [Fate.RAN] * 4
    assert fates[6:] == [(120, Fate.SKIPPED, "after end"), (130, Fate.SKIPPED, "after end")]


async def test_a_job_whose_end_passed_without_its_last_slot_running_is_not_overdue() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(600), id="e", timeout=5, end=T0 + timedelta(minutes=25))
    async def e(ctx: JobContext) -> None:
        raise RuntimeError("down")

    async with scheduler:
        await clock.advance(24 * 60)
        [before] = scheduler.health()
        await clock.advance(10 * 60)
        [after] = scheduler.health()
    assert (before.ended, before.failing) == (False, True)
    assert (after.ended, after.overdue, after.next_fire) == (True, False, None)


def test_a_slot_outside_the_window_is_refused_under_the_lock() -> None:
    async def handler(ctx: JobContext) -> None:
        pass

    job = Job.declare(handler, every(60), id="j", start=T0, end=T0 + timedelta(hours=1))
    state = FleetState()
    early = admit(job, state, T0 - timedelta(seconds=1), 1, manual=False, started=T0)
    late = admit(job, state, T0 + timedelta(hours=2), 1, manual=False, started=T0)
    assert early == Skip("before start") and late == Skip("after end")
    # an operator's trigger runs whatever the window says, as it runs a paused job
    manual = admit(job, state, None, 1, manual=True, started=T0 + timedelta(hours=2))
    assert not isinstance(manual, Skip)


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"start": datetime(2026, 1, 1)}, "start", "must be an aware datetime, got the naive"),
        ({"end": "2026-01-01T00:00Z"}, "end", "must be a datetime with a time zone"),
        (
            {"start": T0, "end": T0 - timedelta(seconds=1)},
            "end",
            "end (2026-03-28T23:59:59+00:00) is before start (2026-03-29T00:00:00+00:00)",
        ),
    ],
)
def test_a_bad_window_is_refused_at_declaration_naming_job_and_field(
    options: dict[str, object], field: str, message: str
) -> None:
    scheduler = Scheduler()

    async def report(ctx: JobContext) -> None:
        pass

    with pytest.raises(ScheduleError, match="^job 'report': ") as caught:
        scheduler.add(report, every(60), id="report", **options)  # type: ignore[arg-type]
    assert caught.value.field == field and message in str(caught.value)
    assert "report" not in scheduler.jobs


async def test_a_stored_schedule_keeps_its_window() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    ran: list[float] = []

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        ran.append(since_t0(ctx.slot))

    start = datetime(2026, 3, 29, 2, 0, tzinfo=timezone(timedelta(hours=2)))  # 00:00 UTC + 0
    async with scheduler:
        put = await scheduler.schedules.put(
            "r",
            task="report",
            trigger=every(60),
            start=start + timedelta(minutes=5),
            end=T0 + timedelta(minutes=8),
            timeout=5,
        )
        assert put.options["start"] == T0 + timedelta(minutes=5)
        got = await scheduler.schedules.get("r")
        assert got == put
        await clock.advance(15 * 60)
    assert ran == [300, 360, 420, 480]


@pytest.mark.postgres
async def test_on_postgres_a_window_is_kept_and_an_ended_job_passes_status(
    pg_dsn: str, pg_schema: str, tmp_path: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a", shutdown_grace=1)
    ran: list[datetime] = []

    async def tick(ctx: JobContext) -> None:
        ran.append(ctx.slot)

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        pass

    now = datetime.now(timezone.utc)
    scheduler.add(tick, every(0.5), id="tick", timeout=0.4, end=now + timedelta(seconds=2))
    async with scheduler:
        later = now + timedelta(days=30)
        put = await scheduler.schedules.put(
            "r",
            task="report",
            trigger=cron("0 9 * * *"),
            start=later,
            end=later + timedelta(days=7),
        )
        assert await scheduler.schedules.get("r") == put  # the instants, read back as written
        await anyio.sleep(3.5)
        jobs = {j.job_id: j for j in await scheduler.fleet.jobs()}
        ledger = await scheduler.fleet.slots("tick", now, now + timedelta(seconds=4))
        [health] = [h for h in scheduler.health() if h.job_id == "tick"]
    assert ran and max(ran) <= now + timedelta(seconds=2)
    assert jobs["tick"].state is JobState.ENDED and health.ended and not health.overdue
    first = cron("0 9 * * *").next_fire(later - timedelta(microseconds=1))
    assert jobs["r"].next_due == first  # not before its start
    assert {s.reason for s in ledger if s.slot > now + timedelta(seconds=2)} == {"after end"}
    # `ticklock status` exits 0: an ended job is not overdue
    argv = [sys.executable, "-m", "ticklock", "status", "--dsn", pg_dsn, "--schema", pg_schema]
    out = await anyio.run_process(argv, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert b"ENDED" in out.stdout


async def test_a_job_whose_window_opens_later_is_not_overdue_before_its_first_slot() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(
        every(3600, initial_delay=1800), id="w", timeout=5, start=T0 + timedelta(minutes=50)
    )
    async def w(ctx: JobContext) -> None:
        pass

    overdue = []
    async with scheduler:
        for _ in range(8):  # its first slot: 0:50 + 30 min
            await clock.advance(600)
            overdue.append(scheduler.health()[0].overdue)
    assert not any(overdue)


def test_a_window_past_the_calendars_reach_is_refused_at_declaration() -> None:
    async def far(ctx: JobContext) -> None:
        pass

    with pytest.raises(ScheduleError, match="start must be before the year 9001") as caught:
        Scheduler().add(far, every(60), id="far", start=datetime(9999, 12, 31, tzinfo=timezone.utc))
    assert caught.value.field == "start"
