"""``catch_up`` as a duration, on a ManualClock: after every replica was down, one run covers
the slots missed within that duration before now; older ones are skipped, and the ledger says
so ("outside the catch-up window")."""

from __future__ import annotations

from datetime import timedelta

import pytest

from helpers import at
from ticklock import JobContext, ScheduleError, Scheduler, cron, every
from ticklock._operators.fleet import Fate
from ticklock._schedule.triggers import Trigger
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")
HOUR = timedelta(hours=1)


async def outage(
    trigger: Trigger, catch_up: object, down: timedelta
) -> tuple[list[tuple[float, float]], list[tuple[float, Fate, str | None]]]:
    """A job runs once at T0, every replica is down for ``down``, a replica starts again and
    runs 10 minutes: its runs (slot, start, in minutes after T0) and the ledger of the day."""
    clock, db = ManualClock(T0 - timedelta(seconds=1)), MemoryDatabase()
    runs: list[tuple[float, float]] = []

    def replica() -> Scheduler:
        scheduler = Scheduler(clock=clock, database=db, owner="a")

        async def report(ctx: JobContext) -> None:
            minutes = (
                (ctx.slot - T0) / timedelta(minutes=1),
                (clock.now() - T0) / timedelta(minutes=1),
            )
            runs.append(minutes)

        scheduler.add(report, trigger, id="report", timeout=5, catch_up=catch_up)  # type: ignore[arg-type]
        return scheduler

    async with replica():
        await clock.advance(1)
    await clock.advance(down.total_seconds())
    async with (scheduler := replica()):
        await clock.advance(600)
        ledger = await scheduler.fleet.slots("report", T0, clock.now())
    minutes = [((s.slot - T0) / timedelta(minutes=1), s.fate, s.reason) for s in ledger]
    return runs, minutes


async def test_an_every_job_covers_only_the_slots_missed_within_the_duration() -> None:
    runs, ledger = await outage(every(600, initial_delay=1), timedelta(minutes=30), 2 * HOUR)
    # back at 2:00: slots 0:10 to 1:20 are older than 30 minutes, the grid's 1:30 is not
    assert runs[:2] == [(0, 0), (90, 120)]
    skipped = [m for m, fate, reason in ledger if fate is Fate.SKIPPED]
    assert skipped == [10, 20, 30, 40, 50, 60, 70, 80]
    reasons = {reason for _, fate, reason in ledger if fate is Fate.SKIPPED}
    assert all(r and r.startswith("outside the catch-up window (1800 s") for r in reasons)


async def test_a_cron_job_covers_the_last_missed_fire_within_the_duration() -> None:
    runs, ledger = await outage(cron("0 * * * *"), timedelta(hours=2), 5.5 * HOUR)
    assert runs[:2] == [(0, 0), (300, 330)]  # 05:00, run at 05:30
    fates = {m: (fate, reason) for m, fate, reason in ledger}
    assert fates[240][0] is Fate.COVERED  # 04:00: within 2 h of the run at 05:30
    for skipped in (60, 120, 180):
        fate, reason = fates[skipped]
        assert fate is Fate.SKIPPED and reason is not None
        assert reason.startswith("outside the catch-up window (7200 s before the next run)")


async def test_a_duration_shorter_than_the_last_miss_runs_nothing_until_the_next_slot() -> None:
    runs, _ = await outage(cron("0 * * * *"), 20 * 60, 5.5 * HOUR)
    assert runs == [(0, 0)]  # 05:00 is older than 20 minutes at 05:30: the next is 06:00
    runs, _ = await outage(cron("0 * * * *"), True, 5.5 * HOUR)
    assert runs[1][0] == 300  # catch_up=True covers the whole outage with 05:00's run


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1h", "catch_up must be True, False or a duration, got '1h'"),
        (0, "catch_up must be positive and finite, got 0 s"),
        (-5, "catch_up must be positive and finite, got -5 s"),
        (None, "catch_up must be True, False or a duration, got None"),
    ],
)
def test_a_bad_catch_up_is_refused_naming_job_and_field(value: object, message: str) -> None:
    async def report(ctx: JobContext) -> None:
        pass

    with pytest.raises(ScheduleError) as caught:
        Scheduler().add(report, every(60), id="report", catch_up=value)  # type: ignore[arg-type]
    assert str(caught.value) == f"job 'report': {message}" and caught.value.field == "catch_up"


async def test_a_retried_catch_up_run_covers_what_its_first_attempt_would_have() -> None:
    # back at 05:30 with catch_up=1.5 h: one run covers 04:00 and 05:00; its first attempt
    # fails and its retry commits 10 s later: 04:00 is covered, measured from the first
    clock, db = ManualClock(T0 - timedelta(seconds=1)), MemoryDatabase()
    calls: list[tuple[float, int]] = []

    def replica() -> Scheduler:
        scheduler = Scheduler(clock=clock, database=db, owner="a")

        async def report(ctx: JobContext) -> None:
            calls.append(((ctx.slot - T0) / timedelta(minutes=1), ctx.attempt))
            if len(calls) == 2:
                raise RuntimeError("once")

        scheduler.add(
            report,
            cron("0 * * * *"),
            id="report",
            timeout=5,
            retries=1,
            retry_backoff=10,
            catch_up=1.5 * 3600,
        )
        return scheduler

    async with replica():
        await clock.advance(1)
    await clock.advance(5.5 * 3600)
    async with (scheduler := replica()):
        await clock.advance(600)
        ledger = await scheduler.fleet.slots("report", T0, clock.now())
    fates = {(s.slot - T0) / timedelta(minutes=1): s.fate for s in ledger}
    assert calls[1:3] == [(300, 1), (300, 2)]
    assert fates[240] is Fate.COVERED and fates[180] is Fate.SKIPPED
